"""Finding the blocks a model repeats (a transformer's layers, a ResNet's residual blocks):
what activation checkpointing wraps and what FSDP shards one by one."""

from __future__ import annotations

from torch import nn

__all__ = ["find_blocks"]


def _param_count(mod: nn.Module) -> int:
    return sum(p.numel() for p in mod.parameters())


def _runs(model: nn.Module) -> list[list[nn.Module]]:
    """Runs of two or more consecutive children of one type, each a module with children of
    its own, in every ``nn.ModuleList`` and ``nn.Sequential`` of ``model``; a run of stages
    (containers that hold runs themselves, as a ResNet's ``layer1``, ``layer2``) gives way
    to the runs inside them."""
    runs: list[list[nn.Module]] = []
    holders: set[int] = set()
    for container in model.modules():
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        children = list(container.children())
        i = 0
        while i < len(children):
            j = i + 1
            while j < len(children) and type(children[j]) is type(children[i]):
                j += 1
            run = children[i:j]
            if len(run) >= 2 and any(True for _ in run[0].children()):
                runs.append(run)
                holders.add(id(container))
            i = j
    return [r for r in runs if not all(id(m) in holders for m in r)]


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks ``model`` repeats, in the order its ``modules()`` lists them.

    The candidates are runs of two or more consecutive children of the same type (each with
    submodules of its own: a transformer layer, a residual block, not a bare ``Linear``) in
    an ``nn.ModuleList`` or ``nn.Sequential``. The run holding the most parameters names the
    block type; the blocks are every member of a run of that type (a ResNet's four stages
    together), none inside another. An empty list: no repeated blocks.

    >>> from torch import nn
    >>> layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    >>> enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    >>> [type(b).__name__ for b in find_blocks(enc)]
    ['TransformerEncoderLayer', 'TransformerEncoderLayer', 'TransformerEncoderLayer']
    >>> find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    []
    """
    runs = _runs(model)
    if not runs:
        return []
    best = max(runs, key=lambda r: (sum(_param_count(m) for m in r), len(r)))
    kind = type(best[0])
    members = {id(m) for run in runs if type(run[0]) is kind for m in run}
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for mod in model.modules():
        if id(mod) in members and id(mod) not in inside:
            blocks.append(mod)
            inside.update(id(m) for m in mod.modules())
    return blocks
