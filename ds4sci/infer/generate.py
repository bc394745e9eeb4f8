"""Sampling sequences from a trained GenSLM (``ds4sci generate``).

Temperature, top-k and top-p (nucleus, Holtzman et al. 2020) sampling; temperature 0 is greedy. In codon mode the
sampler can stop at a stop codon (TAA/TAG/TGA). Decoding is cached (:class:`~ds4sci.models.genslm.model.KVCache`) and
batched over the sequences asked for. Positions are built here (``0..L-1``) and passed to the model.
"""
from __future__ import annotations

import logging

import torch

from ds4sci.data import CodonTokenizer
from ds4sci.data import normalize_sequence
from ds4sci.models.genslm import KVCache

logger = logging.getLogger(__name__)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Keep the ``top_k`` largest logits and the smallest set whose probability reaches ``top_p``;
    ``[V]`` -> ``[V]``."""
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
    logits = logits.clone()
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= top_p  # keep tokens until the mass before them reaches top_p
        logits[order[drop]] = float("-inf")
    return logits


def read_prompt(tokenizer, prompt: str) -> tuple[str, list[int]]:
    """The prompt as the model reads it: ``(text, ids)``; ``text`` is what the output starts with.

    Training data's rule applies (:mod:`ds4sci.data.fasta`, ``data.iupac="n"``, which exports do not record):
    uppercased, ``U`` read as ``T``, the IUPAC ambiguity codes ``R Y S W K M B D H V`` read as ``N``, any other
    character an error. A codon model reads whole codons, so a prompt whose length is not a multiple of 3 is an
    error (it is neither cut nor completed), and a codon holding ``N`` is ``[UNK]`` to the model, as in training;
    ``text`` keeps those bases, so nothing of the prompt disappears from the output. An empty prompt starts from
    ``[CLS]``.
    """
    text = normalize_sequence(prompt, where="prompt")  # a non-nucleotide character is an error
    if text != prompt.upper().replace("U", "T"):
        logger.warning("prompt: ambiguous IUPAC code(s) read as N, as in training data")
    if not text:
        return "", [tokenizer.cls_id]
    if isinstance(tokenizer, CodonTokenizer) and len(text) % 3:
        raise ValueError(f"prompt length {len(text)} is not a multiple of 3: this model reads codons "
                         f"(trailing {text[len(text) - len(text) % 3:]!r}); give whole codons")
    ids = tokenizer.encode(text).tolist()
    unknown = sum(i == tokenizer.unk_id for i in ids)
    if unknown:
        logger.warning("prompt: %d token(s) with N are [UNK] to the model, as in training data", unknown)
    return text, ids


@torch.inference_mode()  # no autograd bookkeeping (version counters, view tracking) on any op of the loop
def sample(model, tokenizer, prompt: str = "", num_tokens: int = 100, *, num_sequences: int = 1,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
           stop_at_stop_codon: bool = False) -> list[str]:
    """Generate ``num_sequences`` continuations of up to ``num_tokens`` tokens after ``prompt``; returns each as the
    prompt (as :func:`read_prompt` reads it) followed by its generated bases.

    The sequences are decoded together, as one batch ``[num_sequences, T]``, with a
    :class:`~ds4sci.models.genslm.model.KVCache`: one forward over the prompt (prefill), then one forward of one
    token per sequence per step, attending to the cached keys and values rather than recomputing the prefix.

    Randomness: sequence ``i`` draws each of its tokens with one ``torch.multinomial`` call on its own
    ``torch.Generator`` seeded with ``seed + i``, so it is reproducible from the seed and equals what
    ``sample(..., num_sequences=1, seed=seed + i)`` returns. Temperature 0 is greedy (no draws). With
    ``stop_at_stop_codon``, a sequence ends at its first stop codon while the others go on.
    """
    if num_tokens < 0 or temperature < 0 or num_sequences < 1:
        raise ValueError(f"need num_tokens >= 0, temperature >= 0 and num_sequences >= 1, got num_tokens={num_tokens}, "
                         f"temperature={temperature}, num_sequences={num_sequences}")
    if stop_at_stop_codon and not isinstance(tokenizer, CodonTokenizer):
        raise ValueError("stop_at_stop_codon needs the codon tokenizer")
    text, ids = read_prompt(tokenizer, prompt)
    n_prompt = len(ids)
    limit = model.config.max_position_embeddings
    if n_prompt + num_tokens > limit:
        way = (f"ask for at most {limit - n_prompt} (--num-tokens), or shorten the prompt" if n_prompt < limit else
               "shorten the prompt")
        raise ValueError(f"prompt ({n_prompt} tokens) + num_tokens={num_tokens} exceeds the model's context of {limit} "
                         f"tokens: the model never sees more than {limit} tokens and generation does not slide past "
                         f"them; {way}")
    weight = model.embed_in.weight
    cache = KVCache(model.config, num_sequences, n_prompt + num_tokens, weight.dtype, weight.device)
    gens = [torch.Generator().manual_seed(seed + i) for i in range(num_sequences)]
    banned = torch.tensor(sorted(tokenizer.special_ids))
    generated: list[list[int]] = [[] for _ in range(num_sequences)]
    live = list(range(num_sequences))  # sequences still growing
    x = torch.tensor([ids]).expand(num_sequences, n_prompt)  # [N, T]: the prompt, then each sequence's last token
    for _ in range(num_tokens):
        positions = torch.arange(cache.length, cache.length + x.shape[1])[None].expand_as(x)  # [N, T]
        logits = model(x.to(weight.device), positions.to(weight.device), cache=cache)[:, -1].float().cpu()  # [N, V]
        logits[:, banned] = float("-inf")  # generate sequence tokens only
        nxt = logits.argmax(-1)  # [N]: greedy; with temperature > 0 each live sequence draws its own
        if temperature > 0:
            for i in live:
                probs = torch.softmax(filter_logits(logits[i] / temperature, top_k, top_p), -1)  # [V]
                nxt[i] = torch.multinomial(probs, 1, generator=gens[i])[0]
        for i in live:
            generated[i].append(int(nxt[i]))
        if stop_at_stop_codon:
            live = [i for i in live if generated[i][-1] not in tokenizer.stop_ids]
        if not live:
            break
        x = nxt[:, None]  # [N, 1]
    return [text + tokenizer.decode(g) for g in generated]
