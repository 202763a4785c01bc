"""The plain torch loop that the README's and launch/README.md's blocks are run in: a tiny
model trained with lr 0 (it never changes, so each interval can be recomputed), a loader of
microbatches with different token counts, and ``print`` captured."""
from types import SimpleNamespace

import torch


def run(code: str, where: str):
    """Run ``code`` as the loop's body; returns (printed, reference) where ``reference(batches)``
    is the (loss sum, token count, correct tokens) of those batches, recomputed directly."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(9, 8), torch.nn.Linear(8, 9))
    g = torch.Generator().manual_seed(2)
    loader = []
    for i in range(20):
        labels = torch.randint(0, 9, (2, 6), generator=g)
        labels[:, i % 5 + 1:] = -100  # microbatches of different token counts
        loader.append({"input_ids": labels.clamp(min=0), "labels": labels})
    printed = []
    ns = {"model": lambda ids: SimpleNamespace(logits=net(ids)), "loader": loader,
          "optimizer": torch.optim.SGD(net.parameters(), lr=0.0), "print": lambda *a: printed.append(a)}
    exec(compile(code, where, "exec"), ns)

    def reference(batches):
        total = count = correct = 0
        with torch.no_grad():
            for batch in batches:
                logits, labels = net(batch["input_ids"])[:, :-1], batch["labels"][:, 1:]
                ok = labels != -100
                total += float(torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"))
                count += int(ok.sum())
                correct += int(((logits.argmax(-1) == labels) & ok).sum())
        return total, count, correct

    return printed, loader, reference
