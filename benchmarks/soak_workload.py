"""The hybrid soak's request stream (benchmarks/hybrid_soak.py): chat turns, first reads of documents, questions that
branch off a read document, and exact repeats, deterministic from the generator's seed; each request with what an
unbounded cache would hit (`ideal`), from the workload's own knowledge, never from the server."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from tiercache.bench import VOCAB

KINDS = ("chat", "doc", "branch", "repeat")


@dataclass
class Item:
    kind: str
    prompt: np.ndarray
    ideal: int
    output: np.ndarray | None = None
    source: str = ""  # conversation / document it belongs to (c3, d1), or the request a repeat repeats (r17)


@dataclass
class Conversation:
    name: str
    turns_left: int
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass
class Document:
    name: str
    tokens: np.ndarray
    questions_left: int
    read: bool = False


class Workload:
    """The request stream; `ideal` of each request is what an unbounded cache would hit (benchmarks/hybrid_soak.py
    says how)."""

    def __init__(self, rng: np.random.Generator, n: int, conversations: int, documents: int, repeat_share: float,
                 repeat_window: int) -> None:
        self.rng, self.n = rng, n
        self.repeat_share = repeat_share
        self.recent: collections.deque[tuple[int, np.ndarray]] = collections.deque(maxlen=repeat_window)
        self._made = collections.Counter()
        self.conversations = [self._conversation() for _ in range(conversations)]
        self.documents = [self._document() for _ in range(documents)]

    def _tokens(self, count: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, count)

    def _conversation(self) -> Conversation:
        self._made["c"] += 1
        return Conversation(f"c{self._made['c']}", int(self.rng.integers(4, 17)))

    def _document(self) -> Document:
        self._made["d"] += 1
        length = int(self.rng.integers(8 * self.n, 40 * self.n + 1))
        return Document(f"d{self._made['d']}", self._tokens(length), int(self.rng.integers(4, 25)))

    def next(self) -> Item:
        if self.recent and self.rng.random() < self.repeat_share:
            index, prompt = self.recent[int(self.rng.integers(len(self.recent)))]
            return Item("repeat", prompt, len(prompt) - 1, source=f"r{index}")
        if self.rng.random() < 0.5:
            slot = int(self.rng.integers(len(self.conversations)))
            conversation = self.conversations[slot]
            user = self._tokens(int(self.rng.integers(int(1.2 * self.n), 3 * self.n + 1)))
            item = Item("chat", np.concatenate([conversation.tokens, user]), len(conversation.tokens),
                        self._tokens(int(self.rng.integers(16, 201))), conversation.name)
            conversation.tokens = np.concatenate([item.prompt, item.output])
            conversation.turns_left -= 1
            if conversation.turns_left == 0:
                self.conversations[slot] = self._conversation()
            return item
        slot = int(self.rng.integers(len(self.documents)))
        document = self.documents[slot]
        question = self._tokens(int(self.rng.integers(20, 61)))
        if not document.read:
            document.read = True
            return Item("doc", np.concatenate([document.tokens, question]), 0, source=document.name)
        x = int(self.rng.integers(self.n, len(document.tokens) + 1))
        document.questions_left -= 1
        if document.questions_left == 0:
            self.documents[slot] = self._document()
        return Item("branch", np.concatenate([document.tokens[:x], question]), x // self.n * self.n,
                    source=document.name)

    def done(self, index: int, item: Item) -> None:
        self.recent.append((index, item.prompt))
