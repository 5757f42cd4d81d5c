"""The target verifying the draft trees of several sequences in one forward.

Cache layout: a ``BatchStore`` (``cache.py``) with one row per running sequence, rows
``[0, rows)`` in use. Every row shares the slot count ``L`` (the longest row's committed
length); row ``b`` holds its committed prefix in slots ``[0, length[b])`` and holes after them.
A verify forward appends ``Q`` slots to every row (``Q`` = the largest tree, smaller trees
padded with copies of their root that only see themselves): node ``i`` of row ``b`` goes to
slot ``L + i`` with position ``length[b] + depth[i]``, and its mask row lets it see slots
``[0, length[b])`` and its ancestors. ``commit`` moves each row's root and accepted nodes to
``length[b], length[b] + 1, ...`` and sets ``L`` to the new longest row: no compaction is ever
needed, holes only trail a row.

A sequence joins (``add``) by a prefill forward of its own on a one-row cache, copied into the
next free row (with ``prefix_cache``, the last row's one-row cache cut to what both contexts
share, or a copy of an earlier prompt's K/V that shares more, ``TargetModel.prefixes``, so only
the rest is computed; several joining at once share one right-padded forward
where ``joint_prefill``: ``add_many``); one leaves (``remove``) by moving the last row into its
place. Exactness rests on each row seeing exactly its own prefix and ancestors:
``tests/test_batch.py`` compares every sequence with its decoding alone.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from lookupdec.model.cache import emptied_cache, new_batch_cache
from lookupdec.model.target import TargetModel, _RowsHead, mask_fill, start_from_prefix, tree_inputs
from lookupdec.native import tree as native_tree  # None where not built: the definition runs
from lookupdec.reference import model as reference_model
from lookupdec.sampling import PartialLogits
from lookupdec.tree import TokenTree

# the most padded tokens (rows x the longest context) one joint prefill forward takes, and the
# most cells of its mask (rows x longest^2: 128 MB in float32; two 4096-token contexts, not three)
PREFILL_TOKENS = 16384
PREFILL_MASK = 1 << 25


class BatchTarget:
    """Up to ``max_rows`` sequences of one ``TargetModel``'s model, verified together."""

    def __init__(self, target: TargetModel, max_rows: int, joint_prefill: bool | None = None,
                 prefix_cache: bool = False) -> None:
        if not target.batchable:
            raise ValueError("batched verification needs a model that takes tree masks, without sliding windows")
        self.target = target
        self.max_rows = max_rows
        self.cache = new_batch_cache(target.num_layers, max_rows)
        self.store = self.cache.slot_store
        self.lengths: list[int] = []  # committed slots per row (the root not included)
        self._fill = torch.finfo(target.dtype).min
        self._base = 0
        # sequences joining together prefill in one forward (``add_many``) where forwards cost
        # about the same whatever their size (a GPU running a small model); on a CPU a prefill
        # is bound by its arithmetic, which padding only adds to
        self.joint_prefill = target.device.type != "cpu" if joint_prefill is None else joint_prefill
        # ``add`` keeps the K/V of what a row's context shares with the last row added alone (an
        # instruction, a chat template: ``EngineConfig.prefix_cache``, as ``TargetModel.prefill``)
        # by prefilling on that row's one-row cache cut there; ``last_reused``: the tokens kept
        self.prefix_cache = prefix_cache
        self._prefix: tuple | None = None  # (one-row cache, its tokens, the weights' state)
        # the one-row cache the last ``add`` filled: the next one that keeps nothing of it fills it
        # again, emptied (``_emptied``, as ``TargetModel._emptied``), its rows already copied out
        self._spare = None
        self.last_reused = 0
        self.last_logits: list = []  # per row the last add/add_many added: its prompt's last logits [vocab]

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @torch.inference_mode()
    def add(self, token_ids: Sequence[int], room: int = 0) -> int:
        """Prefill ``token_ids`` (a sequence's prompt) into a new row; its index. The logits of its
        last token (the first new token's distribution) are ``last_logits[0]``. ``room``: slots
        the row will take beyond its prompt, reserved now (``BatchStore.put_row``)."""
        if self.rows >= self.max_rows:
            raise ValueError(f"the batch is full ({self.max_rows} rows)")
        token_ids = list(token_ids)
        one, common, weights = None, 0, None
        if self.prefix_cache and token_ids:  # the last row's one-row cache or a kept copy (as TargetModel.prefill)
            weights = self.target._weights_state()
            one, common = start_from_prefix(token_ids, weights, self._prefix, self.target.prefixes, self._emptied)
        self._prefix = None  # (until the fill below ends)
        if one is None:
            one = self._emptied()
        self._spare = one
        self.last_logits = [self.target.fill(one, token_ids[common:])]
        if token_ids:
            self.store.put_row(self.rows, one.slot_store, len(token_ids), room=room)
            if self.prefix_cache:
                self._prefix = (one, token_ids, weights)
                self.target.prefixes.save(token_ids, weights, one)
        self.last_reused = common
        self.lengths.append(len(token_ids))
        self.store.rows = self.rows
        return self.rows - 1

    @torch.inference_mode()
    def add_many(self, contexts: Sequence[Sequence[int]], rooms: Sequence[int] | None = None) -> list[int]:
        """Prefill several new rows (each a sequence's prompt), in one forward per group of at
        most ``PREFILL_TOKENS`` padded tokens and ``PREFILL_MASK`` mask cells where
        ``joint_prefill``, else one forward each (``add``); their row indices, in order, and in
        ``last_logits`` the logits of each one's last token.

        A group's rows are right-padded to its longest: row ``b``'s token ``i`` sits at slot and
        position ``i`` and sees its own slots ``[0, i]`` only, so its K/V are what its own
        prefill writes; padding slots (a copy of the row's last token) see the row's tokens and
        land in the row's holes, which every later mask hides. ``rooms``: per context, as
        ``add``'s ``room`` (None: none). All or nothing: if a forward raises (out of memory), the
        rows it had added already leave before the error goes on, so the caller may add them again
        one by one."""
        if self.rows + len(contexts) > self.max_rows:
            raise ValueError(f"the batch is full ({self.max_rows} rows)")
        before = self.rows
        try:
            return self._add_many(contexts, rooms)
        except BaseException:
            self.truncate(before)
            raise

    def _add_many(self, contexts: Sequence[Sequence[int]], rooms: Sequence[int] | None) -> list[int]:
        out, logits, group = [], [], []

        def add(rows: list[int]) -> None:  # rows just added, their logits in ``last_logits``
            out.extend(rows)
            logits.extend(self.last_logits if rows else [])

        rooms = [0] * len(contexts) if rooms is None else list(rooms)
        if not self.joint_prefill:
            for ids, room in zip(contexts, rooms):
                add([self.add(ids, room)])
        else:
            for ids, room in zip(contexts, rooms):
                if not len(ids):  # an empty context: nothing to prefill, no logits (None; never a prompt)
                    add(self._add_group(group))
                    group = []
                    add([self.add(ids, room)])
                    continue
                longest = max([len(ids)] + [len(g) for g, _ in group])
                count = len(group) + 1
                if group and (count * longest > PREFILL_TOKENS or count * longest ** 2 > PREFILL_MASK):
                    add(self._add_group(group))
                    group = []
                group.append((ids, room))
            add(self._add_group(group))
        self.last_logits = logits
        return out

    def _emptied(self):
        """The last ``add``'s one-row cache emptied for a new prompt (its K/V were copied into their
        row and, with ``prefix_cache``, kept in ``TargetModel.prefixes``, so nothing reads them): on
        a CPU a new buffer's pages cost their first touch; a new cache where there is none yet."""
        one, self._spare = self._spare, None
        return emptied_cache(one, self.target.num_layers)

    def _add_group(self, group: Sequence[tuple[Sequence[int], int]]) -> list[int]:
        """Rows for ``group``'s contexts (not empty; each with its ``room``), one right-padded
        forward where there are several (``add`` for one); ``last_logits`` per row."""
        if len(group) <= 1:
            return [self.add(ids, room) for ids, room in group]
        contexts, rooms = [ids for ids, _ in group], [room for _, room in group]
        target = self.target
        if target.body is not None:
            target.body.refresh()
        k, lengths = len(contexts), np.array([len(ids) for ids in contexts], dtype=np.int64)
        width = int(lengths.max())
        ids = np.empty((k, width), dtype=np.int64)
        for b, row in enumerate(contexts):
            ids[b, : len(row)] = row
            ids[b, len(row):] = row[-1]
        slot = np.arange(width)
        allowed = (slot[None, None, :] <= slot[None, :, None]) & (slot[None, None, :] < lengths[:, None, None])
        mask = torch.zeros((k, 1, width, width), dtype=target.dtype)
        mask.masked_fill_(torch.from_numpy(~allowed)[:, None], self._fill)
        positions = torch.arange(width, dtype=torch.int64).repeat(k, 1)
        joint = new_batch_cache(target.num_layers, k)
        joint.slot_store.rows = k
        device = target.device
        # the logits of each row's last token only: the distinct last slots, each row's picked below
        last = sorted(set((lengths - 1).tolist()))
        with target.forward_kernels(k * width):
            logits = target.model(input_ids=torch.from_numpy(ids).to(device), position_ids=positions.to(device),
                                  attention_mask=mask.to(device), past_key_values=joint, use_cache=True,
                                  logits_to_keep=torch.tensor(last, device=device)).logits
        target.take_excess()  # a prefill is no verify forward (as ``TargetModel.fill``)
        self.last_logits = [logits[b, last.index(n - 1)].float() for b, n in enumerate(lengths.tolist())]
        out = []
        for b, n in enumerate(lengths.tolist()):
            self.store.put_row(self.rows, joint.slot_store, n, source_row=b, room=rooms[b])
            self.lengths.append(n)
            self.store.rows = self.rows
            out.append(self.rows - 1)
        return out

    @torch.inference_mode()
    def remove(self, row: int) -> int | None:
        """Free ``row``: the last row moves into its place. Returns the index that moved there
        (the old last row), or None if ``row`` was the last."""
        last = self.rows - 1
        moved = None
        if row != last:
            self.store.move_row(last, row, self.lengths[last])
            self.lengths[row] = self.lengths[last]
            moved = last
        self.lengths.pop()
        self.store.rows = self.rows
        self._set_slots(max(self.lengths, default=0))
        return moved

    def truncate(self, rows: int) -> None:
        """Free every row from ``rows`` on (those added since there were ``rows``): the last
        each time, so nothing moves."""
        while self.rows > rows:
            self.remove(self.rows - 1)

    def prepare(self, n: int) -> float:
        return self.target.prepare(n)

    @torch.inference_mode()
    def verify(self, trees: Sequence[TokenTree], rows: Sequence[Sequence[int] | None] | None = None,
               picks: int = 0):
        """One forward over every row's tree (``trees[b]`` for row ``b``). Returns logits [rows,
        Q, vocab] (float32); row ``b``'s first ``len(trees[b])`` are its nodes'. With ``rows``
        (per tree, the nodes to project, None: all; where the target's ``partial_head``), a list
        of one ``PartialLogits`` or logits tensor [len(tree), vocab] per tree, every selected row
        of the batch projected in one product; with ``picks`` > 0, each selected row's ``picks``
        best token ids too where the output projection makes them as it writes the rows
        (``TargetModel.verify``'s: the greedy walk and recycling read those, not rows of the
        vocabulary's width), in the ``PartialLogits`` of every tree with ``rows``."""
        assert len(trees) == self.rows
        target = self.target
        width = max(len(tree) for tree in trees)
        partial = rows is not None and target.partial_head and any(r is not None for r in rows)
        if partial:
            asked = [r is not None for r in rows]
            rows = [list(range(len(t))) if r is None else list(r) for t, r in zip(trees, rows)]
            flat = [b * width + u for b, r in enumerate(rows) for u in r]
        target.last_prepare_s = target.prepare(len(flat) if partial else width * self.rows)
        ids, positions, mask = self.inputs(trees, width)
        head = _RowsHead(target._head, target.fast_head or target._head, flat, picks) if partial else target.fast_head
        with target.forward_kernels(width * self.rows, head, gqa=target._gqa):
            out = target.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                               past_key_values=self.cache, use_cache=True)
        target.last_prepare_s += target.take_excess()
        if not partial:
            return out.logits.float()
        logits, hidden, tops, per_tree, start = out.logits[0].float(), head.hidden, head.tops, [], 0
        for b, (tree, r) in enumerate(zip(trees, rows)):
            mine = logits[start : start + len(r)]
            mine_tops = tops[start : start + len(r)] if tops is not None and asked[b] else None
            start += len(r)
            if len(r) == len(tree) and mine_tops is None:  # every row of this tree: in node order already
                per_tree.append(mine)
            else:
                per_tree.append(PartialLogits(tree, r, mine, hidden[b, : len(tree)], target._project, tops=mine_tops))
        return per_tree

    def inputs(self, trees: Sequence[TokenTree], width: int):
        """``input_ids`` and ``position_ids`` [rows, width] and the additive mask [rows, 1,
        width, L + width] of one batched verify forward: on the CPU's buffers one call of the
        compiled core (``native.tree.batch_tree_inputs_at``), else (the core not built) its
        definition, ``reference.model.batch_inputs``; moved to the device after."""
        rows, slots = self.rows, self.store.lengths[0]
        self._base = slots  # where the trees' slots begin (commit)
        target = self.target
        if rows == 1 and self.lengths[0] == slots and len(trees[0]) == width:  # no holes, no padding:
            return tree_inputs(trees[0], slots, device=target.device, dtype=target.dtype,
                               tree_mode=True)  # the one-sequence path (compiled; no mask for a chain)
        if native_tree is None:
            return reference_model.batch_inputs(trees, self.lengths, slots, width, device=target.device,
                                                dtype=target.dtype)
        ids = torch.empty((rows, width), dtype=torch.int64)
        positions = torch.empty((rows, width), dtype=torch.int64)
        mask = torch.empty((rows, 1, width, slots + width), dtype=target.dtype)
        native_tree.batch_tree_inputs_at([tree.token_ids for tree in trees], [tree.parents for tree in trees],
                                         self.lengths, slots, width, mask_fill(target.dtype), ids.data_ptr(),
                                         positions.data_ptr(), mask.data_ptr())
        device = target.device
        return ids.to(device), positions.to(device), mask.to(device)

    @torch.inference_mode()
    def commit(self, accepted: Sequence[Sequence[int]]) -> None:
        """Row ``b`` keeps its root and ``accepted[b]`` (node indices) after its prefix."""
        base = self._base
        moves = [(b, [base + node for node in (0, *nodes)], self.lengths[b]) for b, nodes in enumerate(accepted)]
        self.store.gather_rows(moves)
        for b, keep, _ in moves:
            self.lengths[b] += len(keep)
        self._set_slots(max(self.lengths, default=0))

    def _set_slots(self, slots: int) -> None:
        self.store.lengths = [slots] * len(self.store.lengths)
