"""Seeded synthetic workloads: what each request asks for, before any timing.

Every generator draws its prompts as token ids from one ``random.Random(seed)``, in segments
(a system prompt, a question, a past reply), and only then renders them in the requested style:

    segments ──► TOKEN_IDS: the ids, concatenated (completions; exact prompt lengths)
             ──► TEXT:      one word per id, segments on their own lines (completions)
             ──► CHAT:      one message per segment, its words as content (chat completions)

so the same seed gives the same workload in every style. A word is one token for most
tokenizers (common lowercase English words with a leading space), so text prompts come close to
their nominal length; the server's ``usage.prompt_tokens`` gives the exact figure.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
from collections.abc import Sequence


class PromptStyle(enum.Enum):
    TOKEN_IDS = "ids"
    TEXT = "text"
    CHAT = "chat"


@dataclasses.dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # system, user or assistant
    content: str


Prompt = str | tuple[int, ...] | tuple[ChatMessage, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class WorkItem:
    """One request of a workload."""

    prompt: Prompt  # text or token ids (completions) or messages (chat)
    output_len: int  # max_tokens; with ignore_eos, exactly the tokens to generate
    arrival_s: float | None = None  # send time after the start (replayed traces); None: the arrival process
    conversation: int | None = None  # multi-turn: which conversation this turn belongs to
    turn: int = 0  # multi-turn: sent only after turn - 1 of the same conversation finished


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    role: str  # the chat role this segment renders as
    token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class TokenSpace:
    """Where random prompt ids come from: [low, high), clear of most tokenizers' special ids."""

    low: int = 100
    high: int = 10000

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"token id range [{self.low}, {self.high}) is empty")

    def draw(self, rng: random.Random, num: int) -> tuple[int, ...]:
        return tuple(rng.randrange(self.low, self.high) for _ in range(num))


# Common English words, each a single token (with its leading space) in BPE vocabularies.
WORDS = tuple(
    dict.fromkeys(
        """
the of and to in is was for on that with as by at from his her this are be or an it not
which have one had all their were can has more who been two new first also after time other
its but some only into over most may these many such years when than them out all there she
he about made would world part city year used known three under state during school while
war way between work people early called being where life both since name number later high
each then small well long well use family music south north east west water later area power
game house book line form river began best series end light land music great like found show
""".split()
    )
)


def render(segments: Sequence[Segment], style: PromptStyle) -> Prompt:
    if style is PromptStyle.TOKEN_IDS:
        return tuple(t for s in segments for t in s.token_ids)
    if style is PromptStyle.TEXT:
        return "\n".join(_words(s.token_ids) for s in segments)
    return tuple(ChatMessage(s.role, _words(s.token_ids)) for s in segments)


def _words(token_ids: Sequence[int]) -> str:
    return " ".join(WORDS[t % len(WORDS)] for t in token_ids)


def fixed(
    num: int, input_len: int, output_len: int, style: PromptStyle, seed: int, space: TokenSpace = TokenSpace()
) -> list[WorkItem]:
    """``num`` prompts of ``input_len`` tokens, each asking for ``output_len``."""
    rng = random.Random(seed)
    return [
        WorkItem(render([Segment("user", space.draw(rng, input_len))], style), output_len) for _ in range(num)
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class LengthMix:
    """A long-tailed length: log-normal around ``median``, clipped to [low, high]."""

    median: int
    sigma: float  # of log(length); 1.0 puts p90 near 3.6x the median
    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.median <= self.high or self.sigma < 0:
            raise ValueError(f"length mix needs 1 <= low <= median <= high and sigma >= 0, got {self}")

    def draw(self, rng: random.Random) -> int:
        return min(self.high, max(self.low, round(rng.lognormvariate(math.log(self.median), self.sigma))))


def mix(
    num: int,
    inputs: LengthMix,
    outputs: LengthMix,
    style: PromptStyle,
    seed: int,
    space: TokenSpace = TokenSpace(),
) -> list[WorkItem]:
    """Chat-like traffic: most prompts and replies short, a long tail of long ones."""
    rng = random.Random(seed)
    items = []
    for _ in range(num):
        input_len, output_len = inputs.draw(rng), outputs.draw(rng)
        items.append(WorkItem(render([Segment("user", space.draw(rng, input_len))], style), output_len))
    return items


def shared_prefix(
    num_groups: int,
    questions_per_group: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    style: PromptStyle,
    seed: int,
    space: TokenSpace = TokenSpace(),
) -> list[WorkItem]:
    """``num_groups`` system prompts with ``questions_per_group`` questions each, in shuffled order."""
    rng = random.Random(seed)
    prefixes = [Segment("system", space.draw(rng, prefix_len)) for _ in range(num_groups)]
    items = [
        WorkItem(render([prefix, Segment("user", space.draw(rng, question_len))], style), output_len)
        for prefix in prefixes
        for _ in range(questions_per_group)
    ]
    rng.shuffle(items)
    return items


def multi_turn(
    num_conversations: int,
    num_turns: int,
    turn_len: int,
    output_len: int,
    style: PromptStyle,
    seed: int,
    space: TokenSpace = TokenSpace(),
) -> list[WorkItem]:
    """Conversations whose every turn resends the whole history, ordered turn by turn.

    The history holds the planned replies (``output_len`` drawn tokens), not the served ones, so
    the workload is fixed by its seed whatever the server answers.
    """
    rng = random.Random(seed)
    histories: list[list[Segment]] = [[] for _ in range(num_conversations)]
    items = []
    for turn in range(num_turns):
        for conv, history in enumerate(histories):
            if turn > 0:
                history.append(Segment("assistant", space.draw(rng, output_len)))
            history.append(Segment("user", space.draw(rng, turn_len)))
            items.append(WorkItem(render(history, style), output_len, conversation=conv, turn=turn))
    return items


def prompt_len(prompt: Prompt) -> int | None:
    """Exact prompt tokens when the prompt is token ids; None when the server's tokenizer decides."""
    if isinstance(prompt, tuple) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return None
