"""A tiny random-weight Llama and a locally trained tokenizer, for vLLM's CPU backend.

Nothing is downloaded: the tokenizer is a word-level vocabulary trained on
synthetic text, the weights are random (seeded). vLLM's CPU backend needs
``head_dim >= 32``; the model has 2 layers, 2 KV heads of 32.
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = [f"w{i}" for i in range(400)]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tiny_llama(out: Path, *, seed: int = 0) -> Path:
    """Write ``config.json``, weights and tokenizer files into ``out``; return it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(32)) for _ in range(200)]
    corpus.append(" ".join(WORDS))  # every word in the vocabulary
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(
        corpus, trainers.WordLevelTrainer(vocab_size=512, special_tokens=SPECIAL)
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    return out


def make_prompts(count: int, words: int, *, seed: int = 1) -> list[str]:
    """``count`` distinct prompts of ``words`` vocabulary words (one token each)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]
