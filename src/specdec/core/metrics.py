"""What a generation measured: one `Round` record per round, summed into `GenerationStats`.

Definitions are written once, here (after vLLM's spec-decode metrics); the bench, the server's
/metrics and the CLI read these fields and properties and never recompute them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

#: The draft source of the tokens a grammar forces (core.processing: drafted on top of K).
FORCED = "grammar"

#: Draft sources whose name starts with this draft from the request's prediction (drafters.py).
PREDICTION_SOURCE = "prediction"


@dataclass(frozen=True)
class Round:
    """One draft-verify round, built once by the loop and given to the stats and the K policy.

    source      the draft source the policy judged ("none" for a plain target step)
    k           tokens drafted and verified (0: a plain target step)
    n_accepted  drafted tokens kept by the accept rule, 0 <= n_accepted <= k
    n_emitted   tokens committed (accepted + the recovered or bonus token, cut at the budget or
                a stop token)
    draft_s     seconds drafting, the draft model's catch-up prefill left out
    verify_s    seconds of the target pass over k + 1 tokens
    rows        rows of that pass: k + 1 alone (0 says so), more when it verified other
                sequences' rounds too (decode.rounds_together): what v(rows) was measured at
    forced      of the k, the first ones a grammar forced (FORCED);
                the rest are `source`'s
    """

    source: str
    k: int
    n_accepted: int
    n_emitted: int
    draft_s: float = 0.0
    verify_s: float = 0.0
    rows: int = 0
    forced: int = 0

    @property
    def pass_rows(self) -> int:
        return self.rows or self.k + 1


@dataclass
class GenerationStats:
    """Per-generation counters. Definitions (after vLLM's spec-decode metrics):

    rounds            target forward passes after the prefill (one per round; for the baseline,
                      one per generated token)
    drafted           draft tokens proposed and sent to verification
    accepted          drafted tokens kept by the accept rule
    drafted_per_pos   drafted_per_pos[i]: rounds that drafted a token at position i+1
    accepted_per_pos  accepted_per_pos[i]: rounds whose draft at position i+1 was accepted
    generated         tokens committed (accepted + one recovered or bonus token per round)
    drafting_rounds   rounds that drafted at least one token (= drafted_per_pos[0])
    tokens_per_round  generated / rounds: tokens per target pass, K = 0 rounds included (what
                      a k="auto" run that stops drafting still earns per pass: 1.0)
    mean_acceptance_length  1 + accepted / drafting_rounds: vLLM's "mean acceptance length",
                      over rounds that drafted only, the recovered or bonus token included
    acceptance_rate   accepted / drafted (pooled)
    drafted_by_source, accepted_by_source   drafted and accepted, per draft source ("model",
                      "lookup3", "prediction", ...: the names the drafters report)
    accepted_prediction_tokens  drafted tokens taken from the request's prediction that the
                      verifier accepted (OpenAI's usage field of that name)
    rejected_prediction_tokens  drafted from the prediction and not accepted: the rejected one
                      and any drafted after it in the same round (they never reach the output;
                      OpenAI: "tokens in the prediction that did not appear in the completion").
                      Prediction tokens never drafted (after the output stopped following the
                      prediction) are in neither count.
    k_histogram       k_histogram[K]: rounds that verified K drafted tokens (K = 0: plain steps)
    ttft_s            start of the call to the first committed token (includes the prefill and,
                      when speculating, the whole first draft + verify round)
    wall_s            start of the call to the last committed token
    prefill_s         the target's prompt prefill (paid once per request whatever the method;
                      wall_s - prefill_s - catchup_s is the decode phase that the microbench's
                      cost model predicts)
    draft_s           time inside the drafter (draft forward passes and draft-side sampling)
    catchup_s         the part of draft_s a draft model spent prefilling context it had not
                      seen, in a pass of its own (the prompt in the first round; more than
                      drafters.CATCHUP_IN_PASS tokens committed by other rounds); fewer are fed
                      in its first drafting pass and count as drafting
    verify_s          time inside the rounds' target passes (the prefill is prefill_s)
    sampling_s        target-side warping plus the accept/reject walk
    cached_prompt_tokens  prompt tokens whose KV was kept from the previous generation
                      (stream(reuse_prefix=True); OpenAI's usage.prompt_tokens_details.
                      cached_tokens), not prefilled again
    other_s           wall_s minus prefill_s, draft_s, verify_s and sampling_s: bookkeeping,
                      cache truncation, Python
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    k_histogram: dict[int, int] = field(default_factory=dict)
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    generated: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    ttft_s: float = 0.0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    sampling_s: float = 0.0
    prefill_s: float = 0.0
    catchup_s: float = 0.0

    @property
    def other_s(self) -> float:
        spent = self.prefill_s + self.draft_s + self.verify_s + self.sampling_s
        return max(0.0, self.wall_s - spent)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    def _from_prediction(self, counts: dict[str, int]) -> int:
        return sum(n for s, n in counts.items() if s.startswith(PREDICTION_SOURCE))

    @property
    def accepted_prediction_tokens(self) -> int:
        return self._from_prediction(self.accepted_by_source)

    @property
    def rejected_prediction_tokens(self) -> int:
        return self._from_prediction(self.drafted_by_source) - self.accepted_prediction_tokens

    @property
    def drafting_rounds(self) -> int:
        return self.drafted_per_pos[0] if self.drafted_per_pos else 0

    @property
    def mean_acceptance_length(self) -> float:
        n = self.drafting_rounds
        return 1 + self.accepted / n if n else 0.0

    @property
    def positional_acceptance(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_pos, self.drafted_per_pos, strict=True)
        ]

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """generated / decode-phase seconds: the prompt prefills (target and draft) left out."""
        decode_s = self.wall_s - self.prefill_s - self.catchup_s
        return self.generated / decode_s if decode_s > 0 else 0.0

    def record(self, r: Round) -> None:
        """Count one round (see the definitions above)."""
        k, n_accepted = r.k, r.n_accepted
        self.rounds += 1
        self.drafted += k
        self.accepted += n_accepted
        self.generated += r.n_emitted
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
        f = r.forced
        for source, drafted, accepted in (
            (FORCED, f, min(n_accepted, f)),
            (r.source, k - f, max(0, n_accepted - f)),
        ):
            if drafted:
                self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + drafted
                self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + accepted
        grow = k - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for i in range(k):
            self.drafted_per_pos[i] += 1
            self.accepted_per_pos[i] += i < n_accepted

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            other_s=self.other_s,
            acceptance_rate=self.acceptance_rate,
            tokens_per_round=self.tokens_per_round,
            drafting_rounds=self.drafting_rounds,
            accepted_prediction_tokens=self.accepted_prediction_tokens,
            rejected_prediction_tokens=self.rejected_prediction_tokens,
            mean_acceptance_length=self.mean_acceptance_length,
            positional_acceptance=self.positional_acceptance,
            tokens_per_s=self.tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )
        return d


class StopReason(str, Enum):
    """Why a generation ended (`GenerationResult.stop_reason`). A str enum: what is written out
    (the bench's runs, `specdec generate --json`) and what the server maps to a request's
    status (serve.requests.FINISHED_BY) are these strings."""

    LENGTH = "length"  # max_new_tokens reached; also a running generation's, until it stops
    STOP = "stop"  # a stop id was emitted (the last token)
    CANCELLED = "cancelled"  # its `cancelled` check said so during the prefill

    def __str__(self) -> str:  # the value, as StrEnum (Python 3.11) has it, in f-strings too
        return self.value


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids only (a stop id, if hit, is the last one)
    stop_reason: StopReason
    stats: GenerationStats
    logprobs: list = field(default_factory=list)  # core.sampling.TokenLogprob per token, if asked
