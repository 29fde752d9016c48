"""Time 10 training steps of the tiny model on N torch threads, twice: python bench/probe_tiny_train_threads.py N.

On a shared machine, compare N=1 and N=2 (evidence/suite-speed.md)."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import Gemma4ForCausalLM, Gemma4TextConfig  # noqa: E402

from repack.stand_ins.tiny_model import TEXT_CONFIG, _batch, pattern_permutation  # noqa: E402

torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
perm = pattern_permutation(0)
text = Gemma4ForCausalLM(Gemma4TextConfig(**TEXT_CONFIG))
text.train()
opt = torch.optim.AdamW(text.parameters(), lr=3e-3, weight_decay=0.0)
gen = torch.Generator().manual_seed(0)
for rep in range(2):
    t, c = time.time(), time.process_time()
    for _ in range(10):
        ids = _batch(perm, 32, 24, gen)
        loss = text(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(sys.argv[1], "threads: 10 steps", round(time.time() - t, 2), "s wall", round(time.process_time() - c, 2),
          "s cpu", flush=True)
