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

A second change, for the same reason: a prefix over its budget is cut at a line the text
chooses, not at exactly its last 768 tokens. An editor sends the lines before the cursor (256
of them); after each Enter the window slides by a line, and a cut at a fixed token count would
move the prompt's start with it, so every new line would prefill the whole prompt again. Here
the prefix starts at the line with the least hash among those that keep 1/2 to 3/4 of a batch
(content-defined, as rsync's and winnowing's boundaries): the same line while it stays in that
range, so a new line prefills the suffix and the line, not the prefix.
"""

from __future__ import annotations

import zlib
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
    before = prefix_tokens(encode, prefix, 3 * (n_batch // 4))
    after, line = encode(suffix), encode(current)
    after = after[: max(0, n_batch // 4 - 2 - len(line))]
    take = take[max(0, len(take) - max(0, n_ctx - n_batch - 2 * n_predict)) :]
    pre, suf = [fim.pre, *before], [fim.suf, *after]
    body = [*suf, *pre] if spm else [*pre, *suf]
    return [*take, *([bos] if bos is not None else []), *body, fim.mid, *line]


def prefix_tokens(encode: Callable[[str], list[int]], prefix: str, budget: int) -> list[int]:
    """`prefix`'s tokens, at most `budget` of them: all, or those from the line with the least
    hash (crc32 of its text; the first of equals) among the lines that start between `budget`
    and `budget` // 3 * 2 tokens before the end (the module docstring says why); the last
    `budget` where the line-by-line count was short."""
    ids = encode(prefix)
    if len(ids) <= budget:
        return ids
    lines = prefix.splitlines(keepends=True)
    counts = [len(encode(x)) for x in lines]  # close to the joint count: a line ends in "\n"
    least = budget // 3 * 2
    best, best_hash, kept = len(lines), None, 0
    for i in range(len(lines) - 1, -1, -1):  # from the end: the tokens kept from line i on
        kept += counts[i]
        if kept > budget:
            break
        h = zlib.crc32(lines[i].encode())
        if kept >= least and (best_hash is None or h <= best_hash):
            best, best_hash = i, h
    out = encode("".join(lines[best:])) if best < len(lines) else ids
    return out[max(0, len(out) - budget) :]


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
    from specdec.core.generate import generate

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
