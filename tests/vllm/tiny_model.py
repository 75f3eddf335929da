"""Tiny random-weight models and a locally trained tokenizer, for vLLM's CPU backend.

Nothing is downloaded: the tokenizer is a word-level vocabulary trained on
synthetic text, the weights are random (seeded). vLLM's CPU backend needs
``head_dim >= 32``. The Llama has 2 layers, 2 KV heads of 32. The DeepSeek-V2
has 2 dense layers with multi-head latent attention (MLA): one 576-wide latent
per token and layer (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, the only
width vLLM's CPU MLA backend takes), in bf16 (the only dtype it takes). The
Gemma-2 has 4 layers that alternate a 64-token sliding window and full
attention, so vLLM gives its KV cache two groups (a hybrid model). The NemotronH
has 4 layers that alternate Mamba-2 and attention: two KV groups of different
kinds, a Mamba state group and an attention group, whose pages vLLM pads to one
size so that each tensor holds one layer of each.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

WORDS = [f"w{i}" for i in range(400)]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def _tokenizer(out: Path, seed: int) -> Any:
    """Train the word-level tokenizer, save it into ``out`` and return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    return fast


def _common(fast: Any) -> dict[str, Any]:
    return {
        "vocab_size": len(fast),
        "max_position_embeddings": 1024,
        "bos_token_id": fast.bos_token_id,
        "eos_token_id": fast.eos_token_id,
        "pad_token_id": fast.pad_token_id,
        "tie_word_embeddings": False,
    }


def _save_random(out: Path, model_cls: Any, config: Any, seed: int, *, bf16: bool = False) -> Path:
    """Seeded random weights of ``model_cls(config)`` saved into ``out``; returns it."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config)
    if bf16:
        model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def build_tiny_llama(out: Path, *, seed: int = 0) -> Path:
    """Write ``config.json``, weights and tokenizer files into ``out``; return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = _tokenizer(out, seed)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        **_common(fast),
    )
    return _save_random(out, LlamaForCausalLM, config, seed)


def build_tiny_mla(out: Path, *, seed: int = 0) -> Path:
    """A DeepSeek-V2 with MLA (see the module docstring) into ``out``; return it."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    fast = _tokenizer(out, seed)
    config = DeepseekV2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        # every layer dense (the experts are never built, but the config wants them)
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=64,
        **_common(fast),
    )
    return _save_random(out, DeepseekV2ForCausalLM, config, seed, bf16=True)


def build_tiny_sliding(out: Path, *, seed: int = 0) -> Path:
    """A Gemma-2 with sliding-window layers (see the module docstring) into ``out``."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    fast = _tokenizer(out, seed)
    config = Gemma2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=64,
        **dict(_common(fast), tie_word_embeddings=True),  # vLLM's Gemma-2 ties them
    )
    return _save_random(out, Gemma2ForCausalLM, config, seed)


def make_prompts(count: int, words: int, *, seed: int = 1) -> list[str]:
    """``count`` distinct prompts of ``words`` vocabulary words (one token each)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def build_tiny_mamba_hybrid(out: Path, *, seed: int = 0) -> Path:
    """A NemotronH (see the module docstring) into ``out``; return it."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    fast = _tokenizer(out, seed)
    config = NemotronHConfig(
        hidden_size=128,
        intermediate_size=256,
        hybrid_override_pattern="M*M*",  # Mamba-2, attention, Mamba-2, attention
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        mamba_num_heads=4,
        mamba_head_dim=32,
        n_groups=1,
        ssm_state_size=16,
        chunk_size=32,
        **_common(fast),
    )
    return _save_random(out, NemotronHForCausalLM, config, seed)
