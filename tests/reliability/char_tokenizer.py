"""A stand-in tokenizer for the tiny models' CLI and stream tests."""


class CharTokenizer:
    """One id per character (mod the tiny models' vocab of 128), the first 300 characters."""

    def encode(self, text):
        return [ord(c) % 128 for c in text[:300]]
