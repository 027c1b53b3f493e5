"""Tiny models of the real architectures, made locally: random weights, a tokenizer trained on a
synthetic corpus, saved in Hugging Face format so `transformers` loads them offline.

Two tokenizer styles, both trained here with `tokenizers`:
- "bpe" (default): byte-level BPE, as Llama-3, Qwen and GPT-2 use;
- "sentencepiece": what Llama-2 and Mistral ship: a metaspace "▁" pre-tokenizer that prepends "▁"
  to the first word (SentencePiece's dummy prefix), BPE with byte fallback (`<0x00>`..`<0xFF>`
  for any character it has no token for), and a decoder that strips the one leading space the
  dummy prefix added. That strip is why a completion decoded alone loses its leading space.

Tests, demos and benchmarks use these because nothing can be downloaded from a model hub here.
The output is a pure function of (arch, seed, tokenizer): same files, same weights, same tokenizer.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
TOKENIZERS = ("bpe", "sentencepiece")
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
METASPACE = "\u2581"   # "▁": SentencePiece's stand-in for a space
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))
# ChatML, plus tools in the Hermes/Qwen style: the tools listed in the system turn, an
# assistant's calls as `<tool_call>` blocks (arguments as the JSON text they came as), and tool
# results as `<tool_response>` user turns. A call renders exactly as the tool grammar makes the
# model write it, so the next turn of an agent loop shares the whole previous turn's tokens.
TEMPLATE_VERSION = "tools1"   # part of the cache folder's name: a new template, a new model
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ (messages[0]['content'] or '') + '\n\n' }}"
    "{% endif %}"
    "{{ '# Tools\n\nYou may call functions. Their signatures are within <tools></tools>:\n"
    "<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nTo call a function, write a JSON object with its name and arguments "
    "within <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <name>, \"arguments\": "
    "<arguments>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{% set arguments = call['function']['arguments'] %}"
    "{{ '<tool_call>\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ (arguments if arguments is string else arguments | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + (message['content'] or '') + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    'the', 'of', 'and', 'to', 'in', 'is', 'was', 'for', 'on', 'that', 'with', 'as', 'by',
    'at', 'from', 'his', 'her', 'it', 'an', 'were', 'are', 'which', 'this', 'be', 'or',
    'has', 'had', 'not', 'first', 'one', 'their', 'its', 'new', 'after', 'but', 'who',
    'they', 'been', 'have', 'also', 'two', 'time', 'year', 'city', 'school', 'world',
    'group', 'music', 'state', 'house', 'water', 'light', 'river', 'stone', 'paper',
    'cache', 'token', 'prefix', 'model', 'serve', 'request', 'worker', 'gateway', 'radix',
    'tree', 'memory', 'batch', 'stream', 'route', 'cluster', 'pool', 'node', 'page',
    'block', 'queue', 'prompt', 'answer', 'question', 'system', 'user', 'assistant',
    'kernel', 'graph', 'tensor', 'layer', 'attention', 'value', 'key', 'hash', 'match',
    'insert', 'evict', 'lock', 'share', 'reuse', 'compute', 'fast', 'slow', 'small',
    'large', 'red', 'green', 'blue', 'north', 'south', 'east', 'west', 'morning', 'evening',
    'winter', 'summer', 'garden', 'window', 'market', 'über', 'café', 'naïve', 'résumé',
    '東京', '数据', '模型', '🚀', '✓', 'λ', 'π',
)


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        sentence = " ".join(words).capitalize() + rng.choice((".", "?", "!", ",", ":"))
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 99999)}"
        out.append(sentence)
    return out


def train_tokenizer(seed: int = 0, vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer (any UTF-8 text encodes) with a llama-style BOS post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    _add_bos(tok)
    return tok


def train_sentencepiece_tokenizer(seed: int = 0, vocab_size: int = VOCAB_SIZE):
    """A Llama-2/Mistral-style tokenizer: metaspace with a dummy prefix, BPE with byte fallback,
    a decoder that strips the dummy prefix's space; ids: `<unk>`, the special tokens, the 256 byte
    tokens, then the learned pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<unk>", *SPECIAL_TOKENS]
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    # split on "▁" while learning: no merge ever spans two words, as in SentencePiece
    learner.pre_tokenizer = pre_tokenizers.Metaspace(METASPACE, prepend_scheme="first")
    learner.train_from_iterator(_corpus(seed), trainer=trainers.BpeTrainer(
        vocab_size=vocab_size - len(BYTE_TOKENS), special_tokens=specials, show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    vocab = {t: i for i, t in enumerate([*specials, *BYTE_TOKENS])}
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(METASPACE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace(METASPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    _add_bos(tok)
    return tok


def _add_bos(tok) -> None:
    from tokenizers import processors

    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])


def _config(arch: str, vocab_size: int, special: dict[str, int]):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-6, initializer_range=0.25, bos_token_id=special["<s>"],
        eos_token_id=special["</s>"], pad_token_id=special["<pad>"],
    )
    if arch == "llama":  # untied head, Llama-3 RoPE scaling
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256})
    if arch == "qwen2":  # q/k/v bias, tied head
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":  # q/k RMSNorm, head_dim decoupled from hidden_size, tied head
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if arch == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0,
                    tokenizer: str = "bpe") -> Path:
    """Write a tiny random-weight model of `arch` with a `tokenizer`-style tokenizer (see the
    module docstring) to `out_dir` and return the path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(seed) if tokenizer == "bpe" else train_sentencepiece_tokenizer(seed)
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "model_max_length": 2048, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2))

    config = _config(arch, tok.get_vocab_size(), special)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config = GenerationConfig(
        bos_token_id=special["<s>"], pad_token_id=special["<pad>"],
        eos_token_id=[special["</s>"], special["<|im_end|>"]])
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(out, safe_serialization=True)
    return out


def cache_dir() -> Path:
    """Where RadixPool keeps things it makes on first use (`$RADIXPOOL_CACHE_DIR`, else
    `$XDG_CACHE_HOME/radixpool`, else `~/.cache/radixpool`)."""
    if os.environ.get("RADIXPOOL_CACHE_DIR"):
        return Path(os.environ["RADIXPOOL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "radixpool"


def default_tiny_model(arch: str = "llama", seed: int = 0) -> Path:
    """The built-in tiny model, made once in the cache folder and reused afterwards."""
    target = cache_dir() / f"tiny-{arch}-seed{seed}-{TEMPLATE_VERSION}"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        make_tiny_model(staging, arch, seed)
        try:
            staging.rename(target)  # atomic: concurrent first uses never see a half model
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
