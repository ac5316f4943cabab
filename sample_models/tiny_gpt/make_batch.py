"""Regenerate sample.pt beside this script from model.py's sample_batch().

    python sample_models/tiny_gpt/make_batch.py
"""
import importlib.util
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main():
    spec = importlib.util.spec_from_file_location("sample_model_tiny_gpt", HERE / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    batch = module.sample_batch()
    out = HERE / "sample.pt"
    torch.save(batch, out)
    torch.load(out, weights_only=True)  # must round-trip with weights_only=True
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
