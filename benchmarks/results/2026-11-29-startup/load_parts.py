"""Where longspec.load() spends its time: the tokenizer, the weights (read, convert, fuse), packing, head."""
import time, sys
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import longspec
t2 = time.perf_counter()
from transformers import AutoTokenizer
from safetensors.torch import load_file
from longspec.runtime.default_model import default_checkpoint_dir
from longspec.runtime import loading
import transformers
t3 = time.perf_counter()
d = default_checkpoint_dir()
from transformers import AutoConfig
cfg = AutoConfig.from_pretrained(d, local_files_only=True)
t4 = time.perf_counter()
tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
t5 = time.perf_counter()
sd = load_file(str(d / "model.safetensors"))
sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
t6 = time.perf_counter()
m = loading.decoder_from_state_dict(cfg, sd, torch.bfloat16)  # fuse + prepare (packing, huge pages)
t7 = time.perf_counter()
h = m.certified_head
t8 = time.perf_counter()
del m, sd, tok
t9 = time.perf_counter()
full = longspec.load()
t10 = time.perf_counter()
print(f"import torch {t1-t0:.2f} | import longspec {t2-t1:.2f} | import transformers+ {t3-t2:.2f} | config {t4-t3:.2f} | "
      f"tokenizer {t5-t4:.2f} | read+bf16 {t6-t5:.2f} | fuse+prepare {t7-t6:.2f} | head {t8-t7:.2f} || load() {t10-t9:.2f}")
