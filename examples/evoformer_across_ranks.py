"""An Evoformer block across the ranks of a torchrun launch, checked against the same block on one process.

Every rank builds the same block and the same inputs (one seed), so each can compare its result with the
single-process one. ``ds4sci.evoformer_context_parallel`` wraps the block: called as the block is, full tensors in
and out on every rank, while inside it each rank holds only its share of the MSA and pair representations (FastFold's
axial split, all-to-alls between). Every rank prints the largest difference of the outputs and of the gradients
(inputs and parameters) from the single process.

Usage: ``torchrun --nproc-per-node 2 examples/evoformer_across_ranks.py`` (gloo, CPU; N_res and N_seq need not divide
the process count: they are padded with masked rows).
"""
import torch
import torch.distributed as dist

import ds4sci
from ds4sci.models.evoformer import EvoformerBlock


def main() -> float:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights and inputs on every rank
    block = EvoformerBlock(c_m=32, c_z=16, c_hidden_msa_att=8, c_hidden_opm=8, c_hidden_mul=16, c_hidden_pair_att=8,
                           no_heads_msa=4, no_heads_pair=2, transition_n=2, msa_dropout=0.0, pair_dropout=0.0)
    m = torch.randn(1, 5, 21, 32)     # [B, N_seq, N_res, C_m]
    z = torch.randn(1, 21, 21, 16)    # [B, N_res, N_res, C_z]
    msa_mask = torch.ones(1, 5, 21)   # [B, N_seq, N_res]
    pair_mask = torch.ones(1, 21, 21)  # [B, N_res, N_res]

    def step(module):
        """Outputs and every gradient of one forward and backward of ``module``."""
        module.zero_grad(set_to_none=True)
        m_in, z_in = m.clone().requires_grad_(), z.clone().requires_grad_()
        m_out, z_out = module(m_in, z_in, msa_mask, pair_mask)
        (m_out.square().mean() + z_out.square().mean()).backward()
        return [m_out, z_out, m_in.grad, z_in.grad] + [p.grad for p in block.parameters()]

    single = step(block)  # the block on this process alone
    across = step(ds4sci.evoformer_context_parallel(block))  # the same block across every rank
    diff = max((a - b).abs().max().item() for a, b in zip(across, single))
    for turn in range(dist.get_world_size()):  # one rank after another: whole lines, in rank order
        if turn == rank:
            print(f"rank {rank} of {dist.get_world_size()}: largest difference from one process, outputs and "
                  f"gradients: {diff:.1e}", flush=True)
        dist.barrier()
    dist.destroy_process_group()
    return diff


if __name__ == "__main__":
    main()
