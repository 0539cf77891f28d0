"""Fill-in-the-middle: a code model's FIM tokens, found in its own vocabulary, and the prompt that
asks it for the middle between a prefix and a suffix (what an editor's completion sends).

The tokens are looked up by their text, as llama.cpp does for models whose GGUF names none in
its metadata (Qwen2.5-Coder's does not): never by the model's name. The prompt is llama.cpp's
`/infill` layout (tools/server/server-common.cpp, format_prompt_infill), with one change that
keeps it cacheable while a user types: the current line goes after the middle token, as the
start of the middle, where llama.cpp's code puts it before the suffix token (its README says
after the middle token). What changes with each keystroke is then the prompt's last tokens:

    [extra]  <|repo_name|>myproject\\n <|file_sep|>{filename}\\n{text} ... <|file_sep|>filename\\n
    [PSM]    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{current line}
    [SPM]    <|fim_suffix|>{suffix}<|fim_prefix|>{prefix}<|fim_middle|>{current line}

Each piece is tokenized alone and as plain text (a file that holds "<|fim_prefix|>" cannot
inject the token), and cut to llama.cpp's budgets: the prefix's last 3/4 of a batch, the
suffix's first 1/4 less the current line, the extra context's last tokens that leave a batch
and twice the answer free in the context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: The texts of each FIM token across code models (llama.cpp's src/llama-vocab.cpp list).
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
#: llama.cpp's batch at its FIM presets (-b 1024): the budgets below are shares of it.
FIM_BATCH = 1024


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's FIM token ids: prefix, suffix, middle (all three, or no FIM), and the
    optional pad, repository and file-separator tokens."""

    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @property
    def ends(self) -> frozenset[int]:
        """The tokens that end a middle, besides the model's own end tokens: a model that
        starts another file or pads has finished the middle (llama.cpp's end-of-generation)."""
        return frozenset(t for t in (self.pad, self.rep, self.sep) if t is not None)


def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The FIM tokens of `tokenizer`'s vocabulary, found by their texts; None where it lacks a
    prefix, suffix or middle token (the model was not trained to fill in the middle)."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    found = {
        role: next((int(vocab[t]) for t in texts if t in vocab), None)
        for role, texts in FIM_TEXTS.items()
    }
    if found["pre"] is None or found["suf"] is None or found["mid"] is None:
        return None
    return FimTokens(**found)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Extra:
    """A chunk of another file the middle may draw from (an editor's open files, yanks)."""

    text: str
    filename: str = ""


def fim_prompt(
    fim: FimTokens,
    encode: Callable[[str], list[int]],
    prefix: str,
    suffix: str,
    extra: Sequence[Extra] = (),
    current: str = "",
    *,
    n_ctx: int,
    n_predict: int,
    n_batch: int = FIM_BATCH,
    spm: bool = False,
    bos: int | None = None,
) -> list[int]:
    """The token ids that ask for the middle between `prefix` and `suffix` (the module
    docstring's layout and budgets); `encode` tokenizes plain text without special tokens,
    `current` is the current line up to the cursor, `bos` a token the model starts with."""
    take = []
    if fim.rep is not None:
        take += [fim.rep, *encode("myproject\n")]
    for chunk in extra:
        if fim.sep is not None:
            take += [fim.sep, *encode(f"{chunk.filename or 'tmp'}\n")]
        else:
            take += encode("\n\n--- snippet ---\n\n")
        take += encode(chunk.text)
    if fim.sep is not None:
        take += [fim.sep, *encode("filename\n")]
    before, after, line = encode(prefix), encode(suffix), encode(current)
    before = before[max(0, len(before) - 3 * (n_batch // 4)) :]
    after = after[: max(0, n_batch // 4 - 2 - len(line))]
    take = take[max(0, len(take) - max(0, n_ctx - n_batch - 2 * n_predict)) :]
    pre, suf = [fim.pre, *before], [fim.suf, *after]
    body = [*suf, *pre] if spm else [*pre, *suf]
    return [*take, *([bos] if bos is not None else []), *body, fim.mid, *line]


def plain_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """`tokenizer`'s text -> ids with no special tokens added or parsed from the text (HF's
    split_special_tokens; a tokenizer without it is called plainly)."""

    def encode(text: str) -> list[int]:
        if not text:
            return []
        try:
            out = tokenizer(text, add_special_tokens=False, split_special_tokens=True)
        except TypeError:
            out = tokenizer(text, add_special_tokens=False)
        return list(out["input_ids"])

    return encode


def complete(
    model: Any,
    prefix: str,
    suffix: str = "",
    extra: Sequence[Extra | dict[str, str]] = (),
    current: str = "",
    *,
    spm: bool = False,
    **options: Any,
) -> Any:
    """The middle between `prefix` and `suffix` from a FIM code model, as an editor asks for it:
    `specdec.generate` on the FIM prompt (`fim_prompt`: `extra` chunks of other files, each an
    Extra or {"text", "filename"}; `current` the current line up to the cursor), stopping at the
    model's end tokens and its FIM ends. `options` are generate's (draft, drafter, k,
    temperature, max_new_tokens, ...): speculation drafts from the whole prompt, suffix and
    other files included, and the output is distributed exactly as the model's. ValueError
    for a model whose vocabulary has no FIM tokens."""
    from specdec.backends.chat import stop_ids
    from specdec.core.decode import generate

    tokenizer = getattr(model, "tokenizer", None)
    fim = fim_tokens(tokenizer)
    if fim is None:
        raise ValueError(
            f"{model.name} has no fill-in-the-middle tokens in its vocabulary "
            f"(one of {FIM_TEXTS['pre'][:3]} ...): use a FIM-trained code model"
        )
    chunks = [
        c if isinstance(c, Extra) else Extra(c["text"], c.get("filename") or "") for c in extra
    ]
    n_predict = int(options.get("max_new_tokens", 128))
    ids = fim_prompt(
        fim,
        plain_encoder(tokenizer),
        prefix,
        suffix,
        chunks,
        current,
        n_ctx=model.n_ctx,
        n_predict=n_predict,
        spm=spm,
    )
    ends = set(options.pop("stop_ids", None) or stop_ids(tokenizer)) | fim.ends
    return generate(model, ids, stop_ids=ends, **options)
