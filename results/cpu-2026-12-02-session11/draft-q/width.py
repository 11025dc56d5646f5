import json, os, torch
from pathlib import Path
from tokenizers import Tokenizer
from models.loader import load_model
from models.model import TargetModel
from models.tiny import default_model
from tandem.train_data import token_stream
from kernels.noise import top_mass
torch.set_num_threads(2)
m = Path(default_model()); root = Path(os.__file__).parent
files = json.loads((m / "heldout_files.json").read_text())["files"]
tok = Tokenizer.from_file(str(m / "tokenizer.json"))
held = token_stream(tok, root, files)
t = load_model(TargetModel, m, dtype=torch.float32, device="cpu")
with torch.inference_mode():
    x = held[:4 * 512].view(4, 512)
    h = t.model(x, None, None)
    q = torch.softmax(t.compute_logits(h.reshape(-1, h.shape[-1])).float(), -1)
V = q.shape[-1]
for mass in (0.99, 0.999):
    _, ids, p, whole = top_mass(q, mass, 1024)
    n = (p > 0).sum(1).float()
    print(f"V {V} mass {mass}: kept tokens mean {n.mean():.1f} median {n.median():.0f} p90 {n.quantile(0.9):.0f} "
          f"max {n.max():.0f}; whole rows {whole.float().mean():.3f}; bytes/token sparse ~{8*n.mean():.0f} vs dense {4*V}")
