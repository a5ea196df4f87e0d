"""Stop strings followed character by character in time linear in the text (an Aho-Corasick automaton).

A choice's text grows a token at a time, and after each token the stream needs two facts: did a stop
string just complete, and how long is the tail that may still become one (held back, not sent).
Answering them by searching the text's last (longest stop) characters for every stop and every tail
costs the square of the longest stop per token while the text is shorter than it: 16 long stops
made tripling the tokens 9x slower. The automaton's state is the longest tail of the text that is the
start of some stop string; each new character moves it in amortized constant time, its depth is the
held-back length and a flag says whether a stop string ends there. It is built once per set of stops
(cached: every choice of a request shares it), in time linear in their total length, which
MAX_STOP_CHARS bounds.
"""

from __future__ import annotations

from functools import lru_cache

_SPAN = 0x110000  # code points


class StopAutomaton:
    """The trie of the stop strings with its failure links. Its transitions are one dict keyed by
    node * _SPAN + code point, of ints only, so the cached automatons add no objects for the garbage
    collector to walk (a dict per node would: tens of thousands for long stops)."""

    def __init__(self, stops: tuple[str, ...]):
        goto: dict[int, int] = {}
        depth, ends = [0], [False]
        children: list[list[tuple[int, int]]] = [[]]  # (code point, child), for the breadth-first pass
        for s in stops:
            node = 0
            for ch in s:
                key = node * _SPAN + ord(ch)
                nxt = goto.get(key)
                if nxt is None:
                    nxt = goto[key] = len(depth)
                    depth.append(depth[node] + 1)
                    ends.append(False)
                    children.append([])
                    children[node].append((ord(ch), nxt))
                node = nxt
            ends[node] = True
        fail = [0] * len(depth)
        order = [child for _, child in children[0]]  # breadth first: a node's fail link is shallower
        for node in order:
            for code, child in children[node]:
                f = fail[node]
                while f and f * _SPAN + code not in goto:
                    f = fail[f]
                target = goto.get(f * _SPAN + code, 0)
                fail[child] = target if target != child else 0
                ends[child] = ends[child] or ends[fail[child]]
                order.append(child)
        self.goto, self.fail, self.depth, self.ends = goto, fail, depth, ends

    def step(self, node: int, ch: str) -> int:
        goto, fail, code = self.goto, self.fail, ord(ch)
        while node and node * _SPAN + code not in goto:
            node = fail[node]
        return goto.get(node * _SPAN + code, 0)


@lru_cache(maxsize=32)
def automaton(stops: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stops)


class StopTracker:
    """One choice's position in the automaton: `feed(text)` -> whether a stop string completed in it;
    `held` is then the length of the tail that is the start of a stop string."""

    def __init__(self, stops: list[str]):
        self.auto = automaton(tuple(stops))
        self.node = 0

    def feed(self, text: str) -> bool:
        auto, node, hit = self.auto, self.node, False
        for ch in text:
            node = auto.step(node, ch)
            hit = hit or auto.ends[node]
        self.node = node
        return hit

    @property
    def held(self) -> int:
        return self.auto.depth[self.node]
