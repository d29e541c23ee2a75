"""What `pdsdk bench serve` sends: a random dataset (exact token counts) or a multi-turn agent workload.

Prompts are token ids (OpenAI completions take `prompt: [int, ...]`), so the input length is exact on
any engine and tokenizer. Everything is drawn from a seeded generator: two runs send the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

LOW_ID = 10  # skip the first ids, where tokenizers keep their special tokens


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    session: str | None = None
    turn: int = 0


@dataclass
class AgentSpec:
    """A tool-using agent: one shared system prompt + tool definitions, then per session a growing history.

    Each turn sends the whole history, generates `reasoning` + `osl` tokens, keeps only the answer
    (reasoning is dropped from the history, as chat templates do), appends a tool result of
    `tool_result` tokens, and waits `gap_s` seconds (the tool call) before the next turn.
    """
    sessions: int = 8
    turns: int = 4
    system: int = 1024  # system prompt + tool definitions, shared by every session
    user: int = 64  # first user message of a session
    tool_result: int = 128
    reasoning: int = 64
    gap_s: float = 2.0


@dataclass
class Workload:
    kind: str  # random | agent
    num_prompts: int = 100
    isl: int = 1024
    osl: int = 256
    range_ratio: float = 0.0  # lengths drawn uniformly in [x(1-r), x(1+r)]
    vocab: int = 1000
    seed: int = 0
    agent: AgentSpec = field(default_factory=AgentSpec)

    def describe(self) -> str:
        if self.kind == "agent":
            a = self.agent
            return (f"agent: {a.sessions} sessions x {a.turns} turns, system {a.system}, user {a.user}, "
                    f"tool results {a.tool_result}, reasoning {a.reasoning} + answer {self.osl}, gaps {a.gap_s}s")
        return f"random: {self.num_prompts} prompts, ISL {self.isl} / OSL {self.osl}"


def vocab_size(tokenizer_dir: str | None, default: int = 1000) -> int:
    """Ids are drawn below this: the tokenizer's vocabulary size when a folder is given."""
    if not tokenizer_dir:
        return default
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"--tokenizer: {path} not found (give a folder with tokenizer.json)")
    model = json.loads(path.read_text()).get("model", {})
    return len(model.get("vocab", {})) or default


def _lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> np.ndarray:
    if ratio <= 0:
        return np.full(n, mean, dtype=np.int64)
    return rng.integers(max(1, int(mean * (1 - ratio))), int(mean * (1 + ratio)) + 1, size=n)


def random_requests(w: Workload) -> list[Request]:
    """`num_prompts` independent requests; each prompt starts with its index so no two share a prefix."""
    rng = np.random.default_rng(w.seed)
    isl, osl = _lengths(rng, w.num_prompts, w.isl, w.range_ratio), _lengths(rng, w.num_prompts, w.osl, w.range_ratio)
    return [Request([LOW_ID + i % (w.vocab - LOW_ID)] + rng.integers(LOW_ID, w.vocab, int(n) - 1).tolist(), int(o))
            for i, (n, o) in enumerate(zip(isl, osl))]


class AgentSession:
    """One agent session's turns; the next prompt exists only after the previous answer came back."""

    def __init__(self, w: Workload, index: int, shared: list[int]):
        self.w, self.id = w, f"agent-{w.seed}-{index}"
        self.rng = np.random.default_rng([w.seed, index])
        self.history = shared + self._ids(w.agent.user)
        self.turn = 0

    def _ids(self, n: int) -> list[int]:
        return self.rng.integers(LOW_ID, self.w.vocab, n).tolist()

    def next_request(self) -> Request | None:
        if self.turn >= self.w.agent.turns:
            return None
        self.turn += 1
        return Request(list(self.history), self.w.agent.reasoning + self.w.osl, self.id, self.turn)

    def answered(self) -> None:
        """Append the answer (not the reasoning) and the tool's result, as the agent's next turn sends them.

        The answer is `osl` fresh ids rather than the model's own tokens: not every engine returns
        token ids, and for prefix reuse only the history's growth and shared prefix matter."""
        self.history += self._ids(self.w.osl) + self._ids(self.w.agent.tool_result)


def agent_sessions(w: Workload) -> list[AgentSession]:
    shared = np.random.default_rng([w.seed, 1 << 30]).integers(LOW_ID, w.vocab, w.agent.system).tolist()
    return [AgentSession(w, i, shared) for i in range(w.agent.sessions)]
