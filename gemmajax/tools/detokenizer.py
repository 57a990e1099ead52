"""Incremental detokenizer: text deltas whose concatenation equals `Tokenizer.decode` of all ids.

Design: `Tokenizer.decode` is a concatenation of per-token texts, except for byte-fallback runs (decoded
together) and SentencePiece's leading-space rule (first piece only). So the state is just the pending
bytes of the current run (at most 3) and one flag: O(1) per token, no window of earlier tokens to re-decode.
"""

from __future__ import annotations

from collections.abc import Iterable

from gemmajax.tools.tokenizer import _SPACE, Tokenizer, decode_byte_run


class IncrementalDetokenizer:
    """Streams the text of one sequence of token ids.

    `push(id)` returns the new text; bytes of a character split over byte-fallback tokens
    (<0xE4><0xBD><0xA0>) are held until the character is complete, so a delta never ends inside a
    UTF-8 character. `flush()` returns what is still held (as U+FFFD, like `decode`) at the end.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False,
                 prompt_ids: Iterable[int] | None = None):
        """`prompt_ids`: tokens that precede the stream (their text is not emitted); with them the stream is
        decode(prompt + new)[len(decode(prompt)):], e.g. no leading-space strip on the first new token."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._run = bytearray()  # pending bytes of the current byte-fallback run
        self._at_start = True  # SentencePiece may still strip a leading '▁'
        self.num_tokens = 0
        for i in prompt_ids or ():
            self.push(i)
        self.num_tokens = 0

    def push(self, token_id: int) -> str:
        """Consume one token id; return the text it completes (possibly "")."""
        tok = self.tokenizer
        i = int(token_id)
        if not 0 <= i < tok.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {tok.vocab_size})")
        self.num_tokens += 1
        if i in tok._special:
            text = decode_byte_run(self._run, final=True) if self._run else ""
            return text if self.skip_special_tokens else text + tok._text[i]
        b = tok._byte_of.get(i)
        if b is not None:
            self._run.append(b)
            self._at_start = False
            return decode_byte_run(self._run, final=False)
        text = decode_byte_run(self._run, final=True) if self._run else ""
        piece_text = tok._text[i]
        if self._at_start:
            if tok._strip_first and tok._pieces[i].startswith(_SPACE):
                piece_text = piece_text[1:]
            self._at_start = tok._strip_while_empty and not piece_text
        return text + piece_text

    def push_many(self, token_ids) -> str:
        """Consume several ids; return their joined deltas."""
        return "".join(self.push(i) for i in token_ids)

    def flush(self) -> str:
        """End of sequence: the held bytes of an unfinished character, each as U+FFFD."""
        return decode_byte_run(self._run, final=True) if self._run else ""
