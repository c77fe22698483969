"""Built-in models that need nothing from the internet: `resolve("builtin:tiny-qwen3") -> Path`.

`builtin:tiny-qwen3` is a ~1M-parameter random-init Qwen3-architecture causal LM with a byte-level
BPE tokenizer trained locally with `tokenizers`, saved as an ordinary HF model directory (config.json,
model.safetensors, tokenizer files with a ChatML chat template), so everything downstream
(`surogate_jax.load_pretrained`, `transformers.AutoModelForCausalLM` / `AutoTokenizer`) treats it like
any Qwen3 checkpoint. `examples/quickstart.yaml` fine-tunes it on the quickstart chat dataset.
`builtin:tiny-qwen3-moe` is the same with a mixture-of-experts feed-forward (Qwen3-MoE, 8 experts, top 2;
`examples/quickstart_moe.yaml`).

Build on first use: into `$SUROGATE_JAX_CACHE/builtin/<name>` (default cache root
`$XDG_CACHE_HOME/surogate_jax`, else `~/.cache/surogate_jax`). The directory is assembled in a
temporary sibling, finished with a marker file (`surogate_builtin.json`, written last), and renamed
into place; only a directory whose marker matches the current recipe is used, so a killed or
concurrent build never leaves a half directory that a later run picks up (concurrent builders each
build, the first rename wins, the others use the winner's). A recipe change (`RECIPE_VERSION`)
rebuilds. Deterministic: same code -> same tokenizer and weights.

The quickstart dataset generator lives here too (`quickstart_rows`), so that the tokenizer trains on
text generated in-process (this works from a wheel install, which has no `examples/` folder) and
`examples/make_quickstart_data.py`, which writes the committed jsonl files, uses the very same code.

Dataset design: tasks with exact short answers that a ~1M-parameter model learns in about a thousand
CPU steps (measured: ~80-90% held-out exact match). Letter tasks (reverse, count, first letter, last
letter) act on random lowercase strings written one letter per word ("reverse: q x k" -> "k x q"),
and the tokenizer keeps every single letter a token of its own, so the model sees characters, not
BPE chunks whose spelling it would have to memorize; number tasks (sort three digits, the number
after n < 1000) see digits one by one as in Qwen. Eval rows are (task, input) pairs that never occur
in train. (Adding two numbers below 50, uppercasing and copying were tried too and left out: after
1000 steps they stayed at 5-30%, while these tasks reach 75-100%.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import tempfile
import time
from pathlib import Path

from .errors import ModelLoadError

PREFIX = "builtin:"
MARKER = "surogate_builtin.json"
RECIPE_VERSION = 1  # bump when the tokenizer, the model recipe or the dataset generator changes

# ------------------------------------------------------------------------------------------------
# The quickstart dataset (also written to examples/data/ by examples/make_quickstart_data.py)

QUICKSTART_SEED = 1234
QUICKSTART_TRAIN_ROWS = 4000
QUICKSTART_EVAL_ROWS = 200

# task -> phrasings; `{x}` is the task input as shown to the model.
PHRASINGS: dict[str, tuple[str, ...]] = {
    "reverse": ("reverse: {x}", "write backwards: {x}"),
    "count": ("count the letters: {x}", "how many letters: {x}"),
    "first": ("first letter: {x}", "which letter is first: {x}"),
    "last": ("last letter: {x}", "which letter is last: {x}"),
    "sort": ("sort: {x}", "sort the digits: {x}"),
    "next": ("what comes after {x}?", "add one to {x}"),
}
TASKS = tuple(PHRASINGS)


def _spaced(s: str) -> str:
    return " ".join(s)


def _sample(task: str, rng: random.Random) -> tuple[tuple, str, str]:
    """(key, input text, answer) of one random instance; `key` identifies the (task, input) pair."""
    if task in ("reverse", "count", "first", "last"):
        n = rng.randint(2, 8) if task == "count" else rng.randint(3, 6)
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(n))
        answer = {"reverse": _spaced(word[::-1]), "count": str(n), "first": word[0], "last": word[-1]}[task]
        return (task, word), _spaced(word), answer
    if task == "sort":
        digits = [rng.randrange(10) for _ in range(3)]
        return (task, *digits), " ".join(map(str, digits)), " ".join(map(str, sorted(digits)))
    if task == "next":
        n = rng.randrange(1000)
        return (task, n), str(n), str(n + 1)
    raise ValueError(f"unknown task {task!r}")


def _row(task: str, x: str, answer: str, rng: random.Random) -> dict:
    user = rng.choice(PHRASINGS[task]).format(x=x)
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def quickstart_rows(
    n_train: int = QUICKSTART_TRAIN_ROWS, n_eval: int = QUICKSTART_EVAL_ROWS, seed: int = QUICKSTART_SEED
) -> tuple[list[dict], list[dict]]:
    """(train_rows, eval_rows) of chat rows `{"messages": [user, assistant]}`, tasks round-robin.

    Deterministic in (n_train, n_eval, seed). Every (task, input) pair is unique within and across
    the two splits, so eval measures generalization, not recall. Eval rows are drawn first, so
    changing n_train leaves the eval split unchanged.
    """
    rng = random.Random(seed)
    seen: set[tuple] = set()
    splits: list[list[dict]] = []
    for n in (n_eval, n_train):
        rows: list[dict] = []
        while len(rows) < n:
            task = TASKS[len(rows) % len(TASKS)]
            for _ in range(1000):
                key, x, answer = _sample(task, rng)
                if key not in seen:
                    break
            else:
                raise ValueError(f"task {task!r} has too few distinct inputs for {n_train + n_eval} rows")
            seen.add(key)
            rows.append(_row(task, x, answer, rng))
        rng.shuffle(rows)
        splits.append(rows)
    eval_rows, train_rows = splits
    return train_rows, eval_rows


# ------------------------------------------------------------------------------------------------
# The tokenizer

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen2/Qwen3's pre-tokenizer split (letter runs keep one leading non-letter, digits stand alone) with
# one change: a single letter also stands alone (" x" -> " ", "x"), so a letter is the same token
# wherever it appears; with Qwen's rule the answer's first letter ("x" after "\n") and the prompt's
# letters (" x") differ, and in our measurements that delayed learning the string tasks ~2x.
PRE_TOKENIZER_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}{2,}|\p{L}|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ChatML as in Qwen's templates (no default system prompt, no thinking blocks).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _tokenizer_corpus(rows: list[dict]):
    """Training text: the pieces ChatML puts between special tokens (which are added, never learned)."""
    for row in rows:
        for m in row["messages"]:
            yield f"{m['role']}\n"
            yield m["content"]


def train_tokenizer(rows: list[dict], vocab_size: int = 512):
    """A byte-level BPE (Qwen's pre-tokenizer, NFC) trained on `rows`, as a transformers fast tokenizer.

    The trainer stops early when no pair occurs `min_frequency` times, so the vocabulary can come
    out smaller than `vocab_size`. Any text still encodes (byte fallback through the byte alphabet).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(rows), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        model_max_length=512,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


# ------------------------------------------------------------------------------------------------
# The model


def _tiny_qwen3_config(vocab_size: int):
    """~1.03M parameters: small enough for ~4k tokens/s of training on 2 CPU cores; 4 layers, because
    2 layers learned the copying tasks (reverse) about 2x slower per step, i.e. no faster in time."""
    from .models import DecoderConfig

    return DecoderConfig(
        model_type="qwen3",
        vocab_size=-(-vocab_size // 64) * 64,  # padded up to a multiple of 64
        hidden_size=128,
        intermediate_size=512,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        qk_norm=True,
        initializer_range=0.02,
    )


def _tiny_qwen3_moe_config(vocab_size: int):
    """tiny-qwen3 with a mixture-of-experts feed-forward: 8 experts of width 128, top 2, renormalised (as
    Qwen3-30B-A3B routes), so each token runs 2 x 3 x 128 x 128 expert weights a layer; ~2.1M parameters in all."""
    return _tiny_qwen3_config(vocab_size).replace(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                                  moe_intermediate_size=128, norm_topk_prob=True,
                                                  router_aux_loss_coef=0.001)


def _build_tiny_qwen3(out: Path) -> None:
    _build_tiny(out, _tiny_qwen3_config)


def _build_tiny_qwen3_moe(out: Path) -> None:
    _build_tiny(out, _tiny_qwen3_moe_config)


def _build_tiny(out: Path, make_config) -> None:
    """Tokenizer + random-init weights (seed 0) + configs into the fresh directory `out`."""
    import jax
    import jax.numpy as jnp

    from .hf import save_pretrained
    from .models import Decoder

    train_rows, eval_rows = quickstart_rows()
    tokenizer = train_tokenizer(train_rows + eval_rows)
    cfg = make_config(len(tokenizer))
    model = Decoder(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    save_pretrained(out, model, params, dtype=jnp.float32)
    tokenizer.save_pretrained(out)
    # Readable by transformers 4.x too: it does not know v5's "TokenizersBackend" class name, and
    # older 4.x versions read the chat template only from tokenizer_config.json (v5 writes a .jinja).
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))

    # Token ids as Qwen3 checkpoints carry them: bos = pad = <|endoftext|>, eos = <|im_end|>.
    eot, eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT), tokenizer.convert_tokens_to_ids(IM_END)
    hf_cfg = json.loads((out / "config.json").read_text())
    hf_cfg.update(bos_token_id=eot, eos_token_id=eos, pad_token_id=eot)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    generation = dict(bos_token_id=eot, eos_token_id=[eos, eot], pad_token_id=eot, do_sample=False)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


# name -> (builder, one line for listings)
BUILTINS = {
    "tiny-qwen3": (_build_tiny_qwen3, "1M-parameter random-init Qwen3 with a locally trained BPE tokenizer"),
    "tiny-qwen3-moe": (_build_tiny_qwen3_moe, "2M-parameter random-init Qwen3-MoE (8 experts, top 2), same tokenizer"),
}


def available() -> list[str]:
    return [PREFIX + name for name in BUILTINS]


def is_builtin(name: str | os.PathLike) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def cache_root() -> Path:
    """`$SUROGATE_JAX_CACHE`, else `$XDG_CACHE_HOME/surogate_jax`, else `~/.cache/surogate_jax`."""
    if os.environ.get("SUROGATE_JAX_CACHE"):
        return Path(os.environ["SUROGATE_JAX_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "surogate_jax"


def _marker(name: str) -> dict:
    return {"name": PREFIX + name, "recipe_version": RECIPE_VERSION}


def _is_complete(d: Path, name: str) -> bool:
    try:
        return json.loads((d / MARKER).read_text()) == _marker(name)
    except (OSError, ValueError):
        return False


def _remove_stale_builds(parent: Path, name: str, older_than_s: float = 3600.0) -> None:
    """Leftovers of killed builds (never used, since they were never renamed into place)."""
    now = time.time()
    for p in parent.glob(f".{name}.*"):
        try:
            if now - p.stat().st_mtime > older_than_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def resolve(name: str) -> Path:
    """The local HF directory of built-in model `name` ("builtin:tiny-qwen3"), built on first use."""
    key = name[len(PREFIX) :] if is_builtin(name) else name
    if key not in BUILTINS:
        raise ModelLoadError(f"{name}: no such built-in model (available: {', '.join(available())})")
    final = cache_root() / "builtin" / key
    if _is_complete(final, key):
        return final
    build, _ = BUILTINS[key]
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.build-", dir=parent))
    except OSError as e:
        raise ModelLoadError(
            f"{name}: cannot create the model cache under {parent} ({e.strerror or e}); "
            "set SUROGATE_JAX_CACHE to a writable folder"
        ) from None
    try:
        _remove_stale_builds(parent, key)
        out = staging / key
        try:
            build(out)
        except OSError as e:  # disk full, permissions: say where, not a traceback
            raise ModelLoadError(f"{name}: building it under {parent} failed ({e})") from None
        os.chmod(out, 0o755)  # mkdtemp made it 0700; a shared cache should be readable like any folder
        (out / MARKER).write_text(json.dumps(_marker(key), indent=2))  # last: marks the build complete
        try:
            os.rename(out, final)
        except OSError:  # `final` exists: another build won the race, or an outdated/broken one is there
            if _is_complete(final, key):
                return final
            old = staging / "replaced"
            os.rename(final, old)  # a directory rename is atomic; the old one is deleted with staging
            os.rename(out, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
