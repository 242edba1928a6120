"""Held-out probe (issue 17): recommenders and graph networks, whose integer inputs are ids, bag offsets and edge
lists rather than text or pixels.

Run ``python -m bench.heldout_recsys build`` (the dev extra's torch), then ``run``.

A DLRM-style click-through model (13 dense features through a bottom MLP, three categorical ids looked up in
100-row tables, pairwise dot-product interaction by ``bmm`` and ``tril_indices``, a top MLP and a Sigmoid), and an
``nn.EmbeddingBag(mode="sum")`` over flat ``indices`` with ``offsets`` (TorchScript exports it as a ``Loop`` over
the bags, dynamo as a sequence loop), and a two-layer graph convolution written with ``index_add_`` as PyG's
message passing is (``x [num_nodes, 8]``, ``edge_index [2, num_edges]``: gathered at sources, scattered onto
destinations). Random weights; TorchScript (opset 17) and dynamo, dynamic batch and
index count; each checked against torch on two other inputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "recsys"


def _models():
    import torch

    class DLRM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            relu = torch.nn.ReLU
            self.bottom = torch.nn.Sequential(torch.nn.Linear(13, 32), relu(), torch.nn.Linear(32, 16), relu())
            self.tables = torch.nn.ModuleList([torch.nn.Embedding(100, 16) for _ in range(3)])
            self.top = torch.nn.Sequential(torch.nn.Linear(22, 32), relu(), torch.nn.Linear(32, 1), torch.nn.Sigmoid())

        def forward(self, dense, sparse):
            x = self.bottom(dense)
            t = torch.stack([x] + [e(sparse[:, i]) for i, e in enumerate(self.tables)], dim=1)
            z = torch.bmm(t, t.transpose(1, 2))
            li, lj = torch.tril_indices(4, 4, offset=-1)
            return self.top(torch.cat([x, z[:, li, lj]], dim=1))

    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(100, 16, mode="sum")
            self.head = torch.nn.Linear(16, 1)

        def forward(self, indices, offsets):
            return self.head(self.bag(indices, offsets))

    class GCN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        @staticmethod
        def propagate(x, edge_index):
            src, dst = edge_index[0], edge_index[1]
            degree = torch.zeros(x.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0])) + 1
            norm = (degree[src] * degree[dst]).rsqrt().unsqueeze(1)
            return torch.zeros_like(x).index_add_(0, dst, x[src] * norm) + x / degree.unsqueeze(1)

        def forward(self, x, edge_index):
            return self.propagate(self.second(torch.relu(self.propagate(self.first(x), edge_index))), edge_index)

    def gcn_example(nodes):
        return (torch.randn(nodes * 3, 8), torch.randint(0, nodes * 3, (2, nodes * 6)))

    def dlrm_example(batch):
        return (torch.randn(batch, 13), torch.randint(0, 100, (batch, 3)))

    def bag_example(bags):
        return (torch.randint(0, 100, (3 * bags + 1,)), torch.arange(bags) * 3)

    yield "dlrm", DLRM(), dlrm_example, ("dense", "sparse"), ((0, "batch"), (0, "batch"))
    yield "embedding_bag", Bag(), bag_example, ("indices", "offsets"), ((0, "n"), (0, "bags"))
    yield "gcn", GCN(), gcn_example, ("x", "edge_index"), ((0, "num_nodes"), (1, "num_edges"))


def build(only: list[str] | None = None) -> None:
    import torch

    from bench._torch_export import export_both

    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, model, example, names, dims in _models():  # dims: (axis, name) of each input's free axis
        if only and name not in only:
            continue
        model.eval()
        export_both(model, example, names, dims, out=OUT, stem=name, sizes=(2, 3, 5))


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import probe_main

    probe_main(OUT, build, attention=False)
