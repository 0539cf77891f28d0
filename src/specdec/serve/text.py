"""Committed token chunks in, text deltas out: incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Callable

#: Tokens held back while the text ends in U+FFFD. A character is at most 4 bytes, so one split
#: over tokens completes within 3 more, and the text before it goes out at once; a U+FFFD still
#: there MAX_HELD_TOKENS tokens on stands for invalid bytes the model emitted (at a high
#: temperature it may emit any), and goes out as U+FFFD, cut where no byte sequence is split
#: (TextAssembler._cut). Unbounded, an output that kept ending in U+FFFD was re-decoded from
#: its first held token every round: quadratic (issue 33).
MAX_HELD_TOKENS = 4


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

    Held back until resolved: the tokens of an incomplete UTF-8 character at the end (a decode
    that ends in U+FFFD; MAX_HELD_TOKENS of them, 4 x in a case byte tokens never meet, so a
    window stays within the last chunk, the held tokens and the new chunk and a push costs a
    bounded number of decoded tokens, ~27 a token for an output of invalid bytes), and a tail of
    the text that could be the start of a stop string. Stop strings are searched for only where
    the new text can complete one.
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
        n = len(self.tokens)
        if self._read == n:
            return ""
        context = self.decode(self.tokens[self._context : self._read]) if self._read else ""
        window = self.decode(self.tokens[self._context :])
        end = n
        if not final and window.endswith("\ufffd"):
            end, window = self._cut(context, window)
            if end == self._read:
                return ""  # an incomplete character: wait for the tokens that complete it
        common = _common_prefix_len(context, window)
        self._context, self._read = self._read, end
        return window[common:]

    def _cut(self, context: str, whole: str) -> tuple[int, str]:
        """Where to stop reading a window whose text (`whole`) ends in U+FFFD, and the window's
        text up to there: the last token boundary within MAX_HELD_TOKENS of the end where the
        text ends in a whole character (the tokens after it may be an incomplete one); else,
        with more than MAX_HELD_TOKENS held, the last boundary before those that splits no byte
        sequence (the text before it and the text after it make `whole`: its U+FFFD stands
        for invalid bytes, which no later token changes, as an incomplete character is at most
        3 bytes);
        else `_read` (hold), unless 4 x MAX_HELD_TOKENS are held: then MAX_HELD_TOKENS back,
        whatever it ends in (tokens whose bytes never settle there: a random stress test of
        1-3-byte tokens never came that far; byte tokens cannot)."""
        n, read = len(self.tokens), self._read

        def text_to(end: int) -> str:
            return context if end == read else self.decode(self.tokens[self._context : end])

        for end in range(n - 1, max(read, n - MAX_HELD_TOKENS) - 1, -1):
            text = text_to(end)
            if not text.endswith("\ufffd"):
                return end, text
        for end in range(n - MAX_HELD_TOKENS, max(read, n - 2 * MAX_HELD_TOKENS), -1):
            text = text_to(end)
            if text + self.decode(self.tokens[end:]) == whole:  # the cut splits no sequence
                return end, text
        if n - read > 4 * MAX_HELD_TOKENS:
            return n - MAX_HELD_TOKENS, text_to(n - MAX_HELD_TOKENS)
        return read, context

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
