"""The cost cache: measured cost curves (``budget.CostModel``), and the file it shares with the
kernel forms chosen on CPU (``model/kernel_forms.py``), kept between processes in one JSON file.

``~/.cache/lookupdec/cost_curves.json`` (``$XDG_CACHE_HOME``), or ``$LOOKUPDEC_COST_CACHE`` (a
file; ``off`` disables it). Versioned, keyed by architecture, device, dtype, thread count and
kernels; the ``MAX_CACHED_CURVES`` curves updated last. Only a regular file under a size cap is
read or replaced, atomically (``cache_file.py``). A cached curve is another process's: it goes
through ``CostModel.trusted`` and explores at its first choice.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time

from lookupdec import cache_file
from lookupdec.budget import CostModel

log = logging.getLogger("lookupdec")

COST_CACHE_VERSION = 6  # 3: the key names the kernels (model/kernels.py); 4: the body packs only where faster;
# 5: kernel forms re-checked while running (curves cached before measured choices since corrected);
# 6: t(1) only of the root path a request's step takes (batched rows and seeding timed slower paths)
MAX_CACHED_CURVES = 32  # the cost cache keeps the curves updated last


def cost_cache_path() -> str | None:
    """Where measured cost curves and the kernel forms chosen (``model/kernels.py``) are kept:
    ``$LOOKUPDEC_COST_CACHE`` (a file; ``off`` disables the cache), else
    ``$XDG_CACHE_HOME/lookupdec/cost_curves.json`` (``~/.cache`` by default)."""
    env = os.environ.get("LOOKUPDEC_COST_CACHE")
    if env:
        return None if env.lower() in ("0", "off", "none") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lookupdec", "cost_curves.json")


def setup(model_config: dict, device) -> tuple[str, str]:
    """The architecture (not the weights' values: ``model_type-digest``) and the device (on CPU:
    the machine and its core count; not the thread count)."""
    import torch

    arch = {k: v for k, v in model_config.items() if k not in ("_name_or_path", "transformers_version")}
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:16]
    device = torch.device(device)
    where = (f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda"
             else f"{device.type}:{platform.machine()}:{os.cpu_count()}cpus")
    return f"{model_config.get('model_type', '?')}-{digest}", where


def cost_key(model_config: dict, device, dtype, context_tokens: int, kernels: str = "plain") -> str:
    """What a cost curve depends on: the architecture (not the weights' values), the device,
    the dtype, the context length bucket, torch's version, on CPU its thread count, and which
    kernels the forwards use (``TargetModel.kernels``)."""
    import torch

    model, where = setup(model_config, device)
    if torch.device(device).type != "cuda":
        where += f":{torch.get_num_threads()}threads"
    return f"{model}|{where}|{dtype}|ctx{context_tokens}|torch{torch.__version__}|{kernels}"


def read_cache() -> dict | None:
    """The cost cache's document, or None (no cache, unusable or unreadable, another version:
    ``cache_file.read``)."""
    path = cost_cache_path()
    doc = cache_file.read(path) if path else None
    return doc if isinstance(doc, dict) and doc.get("version") == COST_CACHE_VERSION else None


def update_cache(section: str, key: str, entry: dict, bound: int) -> None:
    """Put ``entry`` under ``doc[section][key]`` in the cache file, the ``bound`` entries of the
    section updated last kept (atomically, the other sections as they were; a cache that is not
    a regular file, or unwritable, is left alone: ``cache_file.write``)."""
    path = cost_cache_path()
    if not path:
        return
    try:
        doc = read_cache() or {"version": COST_CACHE_VERSION}
        part = doc.setdefault(section, {})
        if not isinstance(part, dict):
            part = doc[section] = {}
        part[key] = {**entry, "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if len(part) > bound:  # bounded: drop the entries updated longest ago
            kept = sorted(part.items(), key=lambda kv: (kv[0] == key, str(kv[1].get("updated", ""))))
            doc[section] = dict(kept[-bound:])
        doc.setdefault("curves", {})
    except AttributeError as exc:  # (an entry not a dict): the section starts again
        log.debug("cost cache %s: section %s unusable (%r): rewritten", path, section, exc)
        doc[section] = {key: part[key]}
    cache_file.write(path, doc)


def load_cached_cost(key: str) -> CostModel | None:
    doc = read_cache()
    try:
        entry = doc["curves"][key] if doc else None
        if not entry:
            return None
        # another process's curve: re-checked here
        cost = CostModel(entry["sizes"], entry["seconds"], entry.get("counts")).trusted()
        if cost is None:
            log.debug("cost cache entry %s: fewer than two sizes observed lately: measuring", key)
        return cost
    except (ValueError, KeyError, TypeError) as exc:
        log.debug("cost cache entry %s unusable (%r): measuring", key, exc)
        return None


def store_cached_cost(key: str, cost: CostModel) -> None:
    """Add one curve to the cache file (atomically; an unwritable cache is only logged)."""
    update_cache("curves", key, cost.to_dict(), MAX_CACHED_CURVES)
