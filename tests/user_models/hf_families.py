"""Hugging Face causal-LM families from tiny configs, as ``save_pretrained`` writes them (random weights, nothing
downloaded): what each family adds to a Llama-style grouped-query decoder, at 64 hidden units, 2 layers, 4 query
heads over 2 key/value heads of 16, a 256-token vocabulary (OPT: 4 heads of 16, each its own key/value head).
``FUSED`` says what each family's ``export --hf DIR --kv-cache`` file fuses into.

- llama: rotary with llama3 scaling (low/high frequency bands of inv_freq rescaled).
- smollm: SmolLM's shape of Llama: the lm_head tied to the token embeddings, default rotary; built with eager
  attention (the reference ``generate`` runs it; ``--hf`` loads the folder with sdpa, which the folder cannot
  record).
- qwen2: biases on the q/k/v projections.
- qwen3: q/k RMSNorms per head before the rotary.
- mistral: a sliding window of ``WINDOW`` keys, shorter than the prompts and generations the tests run.
- phi3: one fused qkv_proj and one gate_up_proj, split in the module.
- gemma2: soft-capped attention scores (tanh(s / 50) * 50), sliding-window and global layers alternating,
  query_pre_attn_scalar scaling, RMSNorm by (1 + weight), embeddings scaled by sqrt(hidden), soft-capped logits.
  Eager attention: transformers' sdpa path has no soft-capping.
- gemma3: q/k norms, sliding and global layers with two rotary bases (10k local, 1M global).
- phi3_partial: Phi-4-mini's shape of Phi-3: ``partial_rotary_factor`` 0.75, the rotary on each head's first
  3/4 (48 of 64 dims, a head of 64 so that the rotated dims are a multiple of 16, as ONNX Runtime's rotary takes
  them), the rest passed through.
- gpt_neox: GPT-NeoX / Pythia: rotary on each head's first quarter (16 of 64 dims), q/k/v from one projection laid
  out per head ([q k v] of each head side by side), every head its own key/value head, parallel residual
  (attention and MLP both read the layer's input), LayerNorms with biases, GELU MLP, an untied ``embed_out``.
  Hidden 256, 4 heads of 64: GPT-NeoX has no head size apart from hidden / heads. Rotary base 100.
- opt: no rotary: learned positions (a table indexed by position + 2, the positions counted from the attention
  mask), as many key/value heads as heads, biases on every projection, the query scaled before the scores,
  pre-norm LayerNorm (with a bias), ReLU MLP, lm_head tied to the token embeddings.
"""

from dataclasses import dataclass

import torch
import transformers

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
PARTIAL_HEAD_DIM = 64
VOCAB = 256
# Short enough that the export's parity cases and mask probe (up to the recorded max length) stay fast; long
# enough for the tests' prompts and generations.
MAX_POSITIONS = 64
WINDOW = 8
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
SOFTCAP, FINAL_SOFTCAP = 50.0, 30.0
# As tests/user_models/hf_llama.py: initial weights (std 0.02) give attention so flat that greedy tokens barely
# depend on positions; four times them make a position counted wrong show in the tokens.
WEIGHT_SCALE = 4.0

_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POSITIONS,
               pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
_ALTERNATING = ["sliding_attention", "full_attention"]


def _configs():
    # The partial-rotary families' heads are 64 wide (16 elsewhere): their rotated dims (48, 16) must be a multiple
    # of 16 for GroupQueryAttention's rotary, as a real model's are (Phi-4-mini 96 of 128, Pythia 16 or 32 of 64/128).
    return {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            **_COMMON, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 16})),
        "smollm": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True)),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**_COMMON)),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**_COMMON, head_dim=HEAD_DIM)),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(**_COMMON, sliding_window=WINDOW)),
        "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config(**_COMMON)),
        "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
            **_COMMON, head_dim=HEAD_DIM, sliding_window=WINDOW, layer_types=_ALTERNATING, query_pre_attn_scalar=8,
            attn_logit_softcapping=SOFTCAP, final_logit_softcapping=FINAL_SOFTCAP)),
        "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
            **_COMMON, head_dim=HEAD_DIM, sliding_window=WINDOW, layer_types=_ALTERNATING, query_pre_attn_scalar=8)),
        "phi3_partial": (transformers.Phi3ForCausalLM, transformers.Phi3Config(
            **_COMMON, head_dim=PARTIAL_HEAD_DIM, partial_rotary_factor=0.75)),
        "gpt_neox": (transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=HEADS * PARTIAL_HEAD_DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD_ID,
            bos_token_id=BOS_ID, eos_token_id=EOS_ID,
            # a base of 100, not 10k: with 16 of 64 dims rotated, 10k's slow angles leave greedy tokens nearly
            # blind to positions (a gap of 5 after the prompt changed 2 of the tests' 4 prompts; 100: all 4)
            rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.25})),
        "opt": (transformers.OPTForCausalLM, transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, word_embed_proj_dim=HIDDEN, ffn_dim=FFN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, max_position_embeddings=MAX_POSITIONS, dropout=0.0,
            pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)),
    }


FAMILIES = tuple(_configs())
# The families transformers runs with eager attention: Gemma-2's sdpa path has no soft-capping; SmolLM's stands for
# Llama's eager path (the reference generate runs it).
EAGER = {"gemma2", "smollm"}


@dataclass(frozen=True)
class Fused:
    """What a family's ``--kv-cache`` file holds, per layer: ``GroupQueryAttention`` at ``kv_heads`` (the cache
    too), the rotary inside the op (``do_rotary``) or none to move, over ``rotary_dim`` dims of each head (the op's
    cos/sin caches half as wide; None: the whole head), q/k/v packed into the op's query input or left three,
    ``softcap`` on the scores or none."""

    kv_heads: int = KV_HEADS
    rotary: bool = True
    rotary_dim: int | None = None
    packed: bool = True
    softcap: float | None = None


FUSED = {
    "llama": Fused(),
    "smollm": Fused(),
    "qwen2": Fused(),
    # a per-head q/k norm sits between the projections and the op
    "qwen3": Fused(packed=False),
    "mistral": Fused(),
    # one qkv_proj laid out [q | k | v], sliced: the op reads it whole as its packed query
    "phi3": Fused(),
    "gemma2": Fused(softcap=SOFTCAP),
    "gemma3": Fused(packed=False),
    # the rotary on 48 of each head's 64 dims, in the op; one qkv_proj read whole as the packed query, as Phi-3
    "phi3_partial": Fused(rotary_dim=48),
    # the rotary on 16 of 64 dims, in the op; every head its own key/value head; q/k/v split per head out of one
    # projection, packed by reordering its weight columns
    "gpt_neox": Fused(kv_heads=HEADS, rotary_dim=16),
    # every head its own key/value head, learned positions; the query is scaled (a Mul) after its projection
    "opt": Fused(kv_heads=HEADS, rotary=False, packed=False),
}


def config(family: str):
    return _configs()[family][1]


def windows(family: str) -> list[int | None]:
    """Each layer's sliding window in keys (None: global), as the config states it."""
    if family == "mistral":  # every layer windowed
        return [WINDOW] * LAYERS
    types = getattr(config(family), "layer_types", None) or ["full_attention"] * LAYERS
    return [WINDOW if kind == "sliding_attention" else None for kind in types]


def build(family: str):
    """The family's model at random weights (seeded), scaled as ``WEIGHT_SCALE`` says, in eval mode."""
    cls, found = _configs()[family]
    torch.manual_seed(37)
    model = cls._from_config(found, attn_implementation="eager" if family in EAGER else "sdpa")
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() > 1:  # the projections and embeddings; the norms' scales stay as initialised
                weight.mul_(WEIGHT_SCALE)
    return model.eval()


def save(family: str, folder) -> torch.nn.Module:
    """``build(family)`` written to ``folder`` with ``save_pretrained``; the model returned."""
    model = build(family)
    model.save_pretrained(folder)
    return model


# The prompts the family tests generate from: around and past the sliding window (WINDOW keys), so a window's edge
# moves within each row's generation. No id below 3 (pad, eos, bos): onnxruntime-genai finds a prompt's end by the
# pad id.
PROMPT_LENGTHS = (3, 12, 1, 7)
MAX_NEW = 8


def _prompts() -> list[list[int]]:
    import numpy as np

    draw = np.random.default_rng(37)
    return [draw.integers(3, VOCAB, n).tolist() for n in PROMPT_LENGTHS]


PROMPTS = _prompts()


def greedy_alone(model, prompts=PROMPTS, max_new: int = MAX_NEW) -> list[list[int]]:
    """transformers' greedy ``generate`` on each prompt alone: ``max_new`` new tokens, or fewer where the eos id comes
    (kept)."""
    greedy = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=EOS_ID,
                                           pad_token_id=PAD_ID)
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=greedy)
        rows.append(out[0, len(prompt):].tolist())
    return rows
