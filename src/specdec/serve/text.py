"""Committed token chunks in, text deltas out: incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Callable


class TextAssembler:
    """Committed token chunks in, text deltas out, with `stop` strings honoured.

    Decoding is incremental (after TGI's and vLLM's detokenizers): each push decodes only a
    short window, the tokens since the last emitted text plus the chunk before them as context,
    and appends what the window adds past its context. Context matters because tokenizers
    merge pieces across token boundaries (SentencePiece drops a leading space at the start of a
    decode; byte-level BPE splits a character over tokens). A push costs O(window), not O(T).

    `decode(prefix)` need not be a prefix of `decode(prefix + more)` (with
    clean_up_tokenization_spaces "a ." becomes "a."): what was handed out is never taken back,
    and the new text is what the window's decode adds past its longest common prefix with the
    context's decode, so no character is lost. The text is therefore the concatenation of the
    deltas, which streaming and non-streaming responses share.

    Held back until resolved: a window whose decode ends in U+FFFD (an incomplete UTF-8
    character), and a tail of the text that could be the start of a stop string. Stop strings
    are searched for only where the new text can complete one.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.stop = stop
        self._reach = max((len(s) for s in stop), default=1) - 1  # longest proper stop prefix
        self.tokens: list[int] = []
        self._context = 0  # tokens[_context:_read] was decoded last: the next window's context
        self._read = 0  # tokens[:_read] are in `text`
        self.text = ""  # the decoded output, cut at a stop string once one is found
        self.sent = 0  # characters of `text` handed out so far
        self.stopped = False  # a stop string was found

    def push(self, ids: list[int]) -> str:
        """Add one round's committed tokens; return the text that is now safe to hand out."""
        self.tokens += ids
        if self.stopped:
            return ""
        if not self._append(self._new_text(final=False)):
            return ""
        if self.stopped:
            return self._take(len(self.text))
        safe = len(self.text) - _stop_prefix_len(self.text, self.stop, self._reach)
        return self._take(max(safe, self.sent))

    def flush(self) -> str:
        """Everything not yet handed out: call once the generation has ended."""
        if not self.stopped:
            self._append(self._new_text(final=True))
        return self._take(len(self.text))

    def _new_text(self, final: bool) -> str:
        if self._read == len(self.tokens):
            return ""
        context = self.decode(self.tokens[self._context : self._read]) if self._read else ""
        window = self.decode(self.tokens[self._context :])
        if not final and window.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the tokens that complete it
        common = _common_prefix_len(context, window)
        self._context, self._read = self._read, len(self.tokens)
        return window[common:]

    def _append(self, new: str) -> bool:
        """Append `new`; cut at the first stop string it completes. True if anything changed."""
        if not new:
            return False
        start = max(0, len(self.text) - self._reach)  # a stop can begin this far back at most
        self.text += new
        hits = (i for i in (self.text.find(s, start) for s in self.stop) if i >= 0)
        cut = min(hits, default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = self.text[: max(cut, self.sent)]  # what was sent cannot be taken back
        return True

    def _take(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, one comparison
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _stop_prefix_len(text: str, stops: tuple[str, ...], reach: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string
    (only the last `reach` characters can be one)."""
    tail = text[-reach:] if reach else ""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(tail)), best, -1):
            if tail.endswith(s[:n]):
                best = n
                break
    return best
