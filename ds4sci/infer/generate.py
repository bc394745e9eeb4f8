"""Sampling sequences from a trained GenSLM (``ds4sci generate``).

Temperature, top-k and top-p (nucleus, Holtzman et al. 2020) sampling; temperature 0 is greedy. In codon mode the
sampler can stop at a stop codon (TAA/TAG/TGA). Positions are built here (``0..L-1``) and passed to the model.
"""
from __future__ import annotations

import logging

import torch

from ds4sci.data import CodonTokenizer, normalize_sequence

logger = logging.getLogger(__name__)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Keep the ``top_k`` largest logits and the smallest set whose probability reaches ``top_p``; ``[V]`` -> ``[V]``."""
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


@torch.no_grad()
def sample(model, tokenizer, prompt: str = "", num_tokens: int = 100, *, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, seed: int = 0, stop_at_stop_codon: bool = False) -> str:
    """Generate ``num_tokens`` tokens after ``prompt``; returns the prompt (as :func:`read_prompt` reads it) followed
    by the generated bases."""
    if num_tokens < 0 or temperature < 0:
        raise ValueError(f"need num_tokens >= 0 and temperature >= 0, got num_tokens={num_tokens}, "
                         f"temperature={temperature}")
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
    gen = torch.Generator().manual_seed(seed)
    banned = torch.tensor(sorted(tokenizer.special_ids))
    for _ in range(num_tokens):
        x = torch.tensor([ids])  # [1, L]
        logits = model(x, torch.arange(len(ids))[None])[0, -1].float()  # [V]
        logits[banned] = float("-inf")  # generate sequence tokens only
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), -1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        ids.append(nxt)
        if stop_at_stop_codon and nxt in tokenizer.stop_ids:
            break
    return text + tokenizer.decode(ids[n_prompt:])
