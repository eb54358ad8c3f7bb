"""What the framework-integration tests share: a tiny GPT-2 built from a
config (no download), its data, reading a run back, comparing weights."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
import torch

VOCAB, SEQ = 64, 8


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def token_batches(n: int, batch: int = 2, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n * batch, SEQ), generator=gen)
    return [{"input_ids": ids[i * batch:(i + 1) * batch], "labels": ids[i * batch:(i + 1) * batch]}
            for i in range(n)]


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def read_table(run: Path, table: str, rank: int = 0):
    return ds.dataset(Path(run) / f"rank={rank}" / table, format="parquet").to_table().to_pandas()


def manifest(run: Path) -> dict:
    return json.loads((Path(run) / "manifest.json").read_text())


def called_modules(model: torch.nn.Module, run_forward) -> set[str]:
    """Names of the modules that `run_forward()` calls (plain forward hooks)."""
    names, handles = set(), []
    for name, m in model.named_modules():
        handles.append(m.register_forward_hook(lambda *a, _n=name: names.add(_n)))
    try:
        run_forward()
    finally:
        for h in handles:
            h.remove()
    return names


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def summary_json(run: Path) -> dict:
    from click.testing import CliRunner

    from amp_postmortem.cli import main
    result = CliRunner().invoke(main, ["summary", str(run), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)
