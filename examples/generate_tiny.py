"""Generate tokens with the tiny reference model: python examples/generate_tiny.py"""

import torch

from wmoe_compile.models import build_model

model = build_model("tiny")
prompt = torch.randint(0, model.cfg.vocab_size, (1, 8))
print(model.generate(prompt, max_new_tokens=16))
