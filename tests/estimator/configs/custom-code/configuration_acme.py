"""A model type transformers does not know, with its own code (as on the Hub): for the tests."""

from transformers import PretrainedConfig


class AcmeConfig(PretrainedConfig):
    model_type = "acme_lm"

    def __init__(self, hidden_size: int = 64, vocab_size: int = 100, **kwargs: object) -> None:
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        super().__init__(**kwargs)
