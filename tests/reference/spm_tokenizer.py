"""A minimal SentencePiece-BPE tokenizer over a GGUF `tokenizer.ggml.model = llama` vocabulary.

Follows the algorithm llama.cpp uses for this vocabulary type (so token counts match llama-perplexity):
prefix one space, write every space as U+2581, split into UTF-8 characters, then repeatedly merge the
adjacent pair whose concatenation is a vocabulary piece with the highest score (leftmost first on equal
scores); characters that are not pieces become <0xNN> byte tokens. Only used by the self-checks.
"""

import heapq


class SPMTokenizer:
    def __init__(self, tokens, scores, bos_id=1):
        self.tokens = tokens
        self.scores = scores
        self.bos_id = bos_id
        self.piece_to_id = {}
        for i, t in enumerate(tokens):
            self.piece_to_id.setdefault(t, i)
        self.byte_ids = {}
        for b in range(256):
            tid = self.piece_to_id.get("<0x%02X>" % b)
            if tid is not None:
                self.byte_ids[b] = tid

    @classmethod
    def from_reader(cls, r):
        return cls(r.get("tokenizer.ggml.tokens"), r.get("tokenizer.ggml.scores"),
                   int(r.get("tokenizer.ggml.bos_token_id", 1)))

    def encode(self, text, add_bos=True):
        text = (" " + text).replace(" ", "\u2581")
        syms = list(text)                       # current text of each symbol ("" once merged away)
        n = len(syms)
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        heap = []

        def add(left, right):
            if left < 0 or right < 0:
                return
            s = syms[left] + syms[right]
            tid = self.piece_to_id.get(s)
            if tid is None:
                return
            heapq.heappush(heap, (-self.scores[tid], left, right, len(s)))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size \
                    or nxt[left] != right:
                continue
            syms[left] += syms[right]
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            add(prv[left], left)
            add(left, nxt[left])
        out = [self.bos_id] if add_bos else []
        i = 0
        while i != -1:
            s = syms[i]
            tid = self.piece_to_id.get(s)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.byte_ids[b] for b in s.encode("utf-8"))
            i = nxt[i]
        return out
