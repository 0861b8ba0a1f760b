"""The byte tokenizer: the one tokenizer that needs no download.

A real GPT-2 or OPT model comes with a BPE tokenizer (50k merges) that lives on the Hugging Face hub
next to the weights. The offline models ``tiny-gpt2`` and ``tiny-opt`` (see :mod:`.loader`) have
no files anywhere, so they use the simplest tokenizer there is: one token per UTF-8 byte.

- ids 0..255 are the bytes themselves (``"A"`` is 65; ``"é"`` is two tokens, 195 169);
- 256 is ``<|endoftext|>``, the end-of-sequence token (GPT-2's name for it);
- 257 is ``<pad>``, which only fills out batches and never carries meaning.

A model with more ids than that -- ``gpt2-size-random`` has GPT-2's 50,257, and random weights
sample any of them -- gets ``ByteTokenizer(vocab_size=50257)``: an id past the 258 decodes as
the byte ``id % 256``. The text is gibberish either way; this way it is as long as the tokens
that made it, and stop strings match about as often as on ``tiny-gpt2`` (a server, or a load
test, can then run it like any other model).

So ``vocab_size`` is 258 (unless given), and a prompt of *n* ASCII characters is exactly *n*
tokens -- handy when a lab wants to fill exactly three KV-cache blocks. It has the few members of
a Hugging Face tokenizer that pagedlearn uses (``encode``, ``decode``, ``eos_token_id``,
``pad_token_id``), so code written against it also runs with ``AutoTokenizer``.

>>> tok = ByteTokenizer()
>>> tok.encode("hé!")
[104, 195, 169, 33]
>>> tok.decode([104, 195, 169, 33, 256])
'hé!'
>>> tok.decode([104, 105, 256, 257], skip_special_tokens=False)
'hi<|endoftext|><pad>'
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedlearn.errors import PagedLearnError


class TokenizerError(PagedLearnError, ValueError):
    """A tokenizer was handed something it cannot encode or decode (an id outside its vocabulary,
    text that is not a ``str``). Also a ``ValueError``."""


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus an end-of-sequence and a padding token (258 ids in all)."""

    NUM_BYTES = 256
    EOS_TOKEN = "<|endoftext|>"
    PAD_TOKEN = "<pad>"

    name_or_path = "pagedlearn/byte"
    vocab_size = NUM_BYTES + 2  # unless a model with more ids asks for more (see above)
    eos_token_id = NUM_BYTES  # 256
    pad_token_id = NUM_BYTES + 1  # 257
    bos_token_id = None  # like GPT-2, nothing is put in front of a prompt
    eos_token = EOS_TOKEN
    pad_token = PAD_TOKEN

    def __init__(self, vocab_size: int | None = None) -> None:
        if vocab_size is not None:
            if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
                raise TokenizerError(f"vocab_size must be an int, got {vocab_size!r}")
            if vocab_size < self.NUM_BYTES + 2:
                raise TokenizerError(
                    f"vocab_size must be at least {self.NUM_BYTES + 2} (the bytes, EOS and "
                    f"padding), got {vocab_size}"
                )
            self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eos={self.eos_token_id})"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: its UTF-8 bytes. No special token is added."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (a list, or a 1-D tensor). Bytes that do not form valid UTF-8 -- e.g. a
        generation cut off in the middle of a multi-byte character -- become U+FFFD instead of
        raising, as with Hugging Face tokenizers."""
        names = {self.eos_token_id: self.EOS_TOKEN, self.pad_token_id: self.PAD_TOKEN}
        pieces: list[str] = []
        run = bytearray()  # bytes since the last special token, decoded together
        for token in ids:
            i = int(token)  # also takes 0-d tensors and numpy ints
            if 0 <= i < self.NUM_BYTES:
                run.append(i)
            elif i in names:
                pieces.append(run.decode("utf-8", errors="replace"))
                run.clear()
                if not skip_special_tokens:
                    pieces.append(names[i])
            elif self.NUM_BYTES + 2 <= i < self.vocab_size:  # a bigger model's id (see above)
                run.append(i % self.NUM_BYTES)
            else:
                raise TokenizerError(
                    f"token id {i} is outside the byte vocabulary (0..{self.vocab_size - 1}); "
                    "was it produced by a model with a different tokenizer?"
                )
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of text one token can stand for, or None if unknown: a text of more
    than ``n * max_chars_per_token(tok)`` characters is more than ``n`` tokens, known without
    tokenizing it (the server refuses a prompt that long before spending seconds on it).

    The byte tokenizer: 1 (a character is at least one byte). A Hugging Face tokenizer: its
    longest vocabulary entry -- in a byte-level BPE (GPT-2, OPT, SmolLM2) each character of an
    entry is one byte of text, and in a SentencePiece one a character of text. (A normalizer
    that merges characters, NFC say, can make text shorter before it is split: callers keep a
    margin.)"""
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    vocab = getattr(tokenizer, "get_vocab", None)
    return max(map(len, vocab()), default=None) if vocab is not None else None
