"""A tiny causal LM shipped as a model's own code (``auto_map``): for the tests."""

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_acme import AcmeConfig


class AcmeForCausalLM(PreTrainedModel):
    config_class = AcmeConfig
    main_input_name = "input_ids"

    def __init__(self, config: AcmeConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.mix = nn.Linear(config.hidden_size, config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_: object):
        logits = self.head(torch.tanh(self.mix(self.embed(input_ids))))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return CausalLMOutput(loss=loss, logits=logits)
