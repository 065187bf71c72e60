"""Sum a row-sparse gradient over a process group, sending only the rows some rank touched.

An embedding lookup's gradient `[vocab/tp, h]` is zero outside the rows of the batch's
tokens: a few hundred or thousand rows of tens of thousands. Summing it over data
parallelism needs only the union of the ranks' touched rows: an all-reduce (MAX) of a
one-byte mask `[vocab/tp]` finds it (`RowUnion`), a second all-reduce sums those rows.
When the union covers half the table or more, the whole table is summed instead.

The mask comes from the looked-up ids when the caller has them (no pass over the table),
else from the gradient's values. It can be started early, from the ids seen in the
forward pass (`RowUnion(..., async_op=True)`); the sum then checks that every rank's
gradient stays inside it, and agrees on that through a flag summed with the rows, so a
wrong prediction costs a second exchange, never a wrong sum. A gradient already inside such
a union can be cut down to its rows as soon as it is computed (`RowUnion.gather`), so the
full-table tensor is freed then and not after the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["GatheredRows", "RowUnion", "sum_touched_rows"]


class GatheredRows:
    """A `[num_rows, h]` gradient kept as its rows `index` `[u]` (ascending, a union's) and
    their `values` `[u, h]`; zero elsewhere."""

    def __init__(self, index: torch.Tensor, values: torch.Tensor, num_rows: int) -> None:
        self.index, self.values, self.num_rows = index, values, num_rows

    def dense(self) -> torch.Tensor:
        out = self.values.new_zeros(self.num_rows, self.values.shape[1])
        return out.index_copy_(0, self.index, self.values)


class RowUnion:
    """The union over `group` of the rows each rank touched: this rank's `rows` (int64
    `[n]`, repeats allowed, `num_rows` standing for none) or, without them, the nonzero rows
    of `grad` `[num_rows, h]`."""

    def __init__(self, num_rows: int, group: dist.ProcessGroup, *, rows: torch.Tensor | None = None,
                 grad: torch.Tensor | None = None, async_op: bool = False) -> None:
        if rows is None and grad is None:
            raise ValueError("tpcore: RowUnion needs the rows or the gradient")
        # The mask with one more entry, always set, for `num_rows` (none) in `rows`.
        self._padded = torch.zeros(num_rows + 1, dtype=torch.uint8, device=(rows if rows is not None else grad).device)
        self.mask = self._padded[:num_rows]
        if rows is not None:
            self._padded[rows] = 1  # index_put: no host sync
        else:
            self.mask.copy_(grad.ne(0).any(dim=1))  # NaN and inf rows count as touched
        self._padded[num_rows] = 1
        self._work = dist.all_reduce(self.mask, op=dist.ReduceOp.MAX, group=group, async_op=async_op)
        self._index: torch.Tensor | None = None

    def index(self) -> torch.Tensor:
        """`[u]` int64: the rows some rank touched, ascending (the same on every rank)."""
        if self._index is None:
            if self._work is not None:
                self._work.wait()
            self._index = self.mask.nonzero().squeeze(1)
        return self._index

    def covers(self, rows: torch.Tensor) -> bool:
        """Whether every one of `rows` (`num_rows` standing for none) is in the union."""
        self.index()
        return bool(self._padded[rows].all())

    def gather(self, grad: torch.Tensor, rows: torch.Tensor | None) -> GatheredRows | None:
        """`grad` `[num_rows, h]` cut down to the union's rows, if `rows` (where it may be
        nonzero) are all in the union and the union is less than half the table (else the
        whole table is summed and nothing is gained); None otherwise."""
        if rows is None or 2 * self.index().numel() >= self.mask.numel() or not self.covers(rows):
            return None
        return GatheredRows(self._index, grad.index_select(0, self._index), self.mask.numel())


def sum_touched_rows(
    grad: torch.Tensor | GatheredRows, group: dist.ProcessGroup, dtype: torch.dtype, rows: torch.Tensor | None = None,
    union: RowUnion | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """The sum over `group` of every rank's `grad` `[num_rows, h]` (or its rows gathered
    by `union.gather`).

    `rows` (int64 `[n]`, repeats allowed, `num_rows` standing for none), if given, holds
    every row where this rank's `grad` may be nonzero. `union`, if given, is a union every
    rank started earlier (from predicted rows). Returns `(index, values)`: `values` `[u, h]` (in `dtype`) are the sums of the rows
    `index` `[u]`, every other row summing to zero; `index` is None when `values` is the
    whole table; None when every rank's gradient is zero. The result is the same on every
    rank, bit for bit, and so is the sequence of collectives.
    """
    if not isinstance(grad, GatheredRows) and grad.dim() != 2:
        raise ValueError(f"tpcore: sum_touched_rows: expected a [rows, h] gradient, got shape {list(grad.shape)}")
    if union is not None:
        outside = rows is None or not union.covers(rows)
        result, anyone_outside = _sum_rows(grad, union.index(), group, dtype, outside)
        if not anyone_outside:
            return result
    if isinstance(grad, GatheredRows):  # another rank's rows were not predicted: rare
        grad = grad.dense()
    result, _ = _sum_rows(grad, RowUnion(grad.shape[0], group, rows=rows, grad=grad).index(), group, dtype, None)
    return result


def _sum_rows(grad: torch.Tensor | GatheredRows, index: torch.Tensor, group: dist.ProcessGroup, dtype: torch.dtype,
              flag: bool | None) -> tuple[tuple[torch.Tensor | None, torch.Tensor] | None, bool]:
    """All-reduce `grad`'s rows `index` (the whole table if they are half of it or more),
    with `flag` (if not None) summed beside them: (result, whether any rank's flag was set)."""
    if index.numel() == 0 and flag is None:
        return None, False
    if isinstance(grad, GatheredRows) and grad.index is not index:
        grad = grad.dense()
    gathered = isinstance(grad, GatheredRows)  # then its rows are `index`, under half the table
    source = grad.values if gathered else grad
    num_rows, h = grad.num_rows if gathered else grad.shape[0], source.shape[1]
    whole = 2 * index.numel() >= num_rows
    u = num_rows if whole else index.numel()
    # One buffer for the rows and the flag: the fewest small operations after the backward.
    flat = torch.empty(u * h + (flag is not None), dtype=dtype, device=source.device)
    body = flat[: u * h].view(u, h)
    if gathered or whole:
        body.copy_(source)
    elif grad.dtype == dtype:
        torch.index_select(grad, 0, index, out=body)
    else:
        body.copy_(grad.index_select(0, index))
    if flag is not None:
        flat[-1] = float(flag)
    flat = comm.all_reduce(flat, group)
    anyone = flag is not None and flat[-1].item() > 0
    if index.numel() == 0:
        return None, anyone
    return (None if whole else index, flat[: u * h].view(u, h)), anyone
