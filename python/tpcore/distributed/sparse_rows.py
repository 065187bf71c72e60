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
wrong prediction costs a second exchange, never a wrong sum. A lookup's gradient given
token by token (`[tokens, h]`, see `tensor_parallel/gradient_sink.py`) is summed straight
into the union's rows (`RowUnion.gather`) or into a table (`add_token_rows`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["GatheredRows", "RowUnion", "add_token_rows", "sum_touched_rows"]


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

    def __init__(
        self,
        num_rows: int,
        group: dist.ProcessGroup,
        *,
        rows: torch.Tensor | None = None,
        grad: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> None:
        if rows is None and grad is None:
            raise ValueError("tpcore: RowUnion needs the rows or the gradient")
        # The mask with one more entry, always set, for `num_rows` (none) in `rows`.
        self._padded = torch.zeros(
            num_rows + 1, dtype=torch.uint8, device=(rows if rows is not None else grad).device
        )
        self.mask = self._padded[:num_rows]
        if rows is not None:
            self._padded[rows] = 1  # index_put: no host sync
        else:
            self.mask.copy_(grad.ne(0).any(dim=1))  # NaN and inf rows count as touched
        self._padded[num_rows] = 1
        self._work = dist.all_reduce(
            self.mask, op=dist.ReduceOp.MAX, group=group, async_op=async_op
        )
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

    def gather(
        self, rows: torch.Tensor, grads: torch.Tensor, dtype: torch.dtype
    ) -> GatheredRows | None:
        """The gradient given token by token (`rows` `[n]`, `num_rows` for none; `grads`
        `[n, h]`) summed (in `dtype`) into the union's rows, if they are all in the union
        and it is less than half the table (else the whole table is summed); None otherwise."""
        index = self.index()
        if 2 * index.numel() >= self.mask.numel() or not self.covers(rows):
            return None
        values = torch.zeros(index.numel(), grads.shape[1], dtype=dtype, device=grads.device)
        # Each token's place in the union (tokens with no row are skipped).
        at = torch.searchsorted(index, rows).clamp_(max=max(index.numel() - 1, 0))
        add_token_rows(values, at, grads, valid=rows < self.mask.numel())
        return GatheredRows(index, values, self.mask.numel())


def add_token_rows(
    out: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Add each token's gradient `grads` `[n, h]` to its row `rows` `[n]` of `out`
    `[num_rows, h]`, skipping tokens whose row is `num_rows` (none) or, if given, where
    `valid` is False. Sums in fp32 at least (a bf16 or fp16 `out` gets each row's sum rounded
    once, as the lookup's own backward does), in token order: the same bits on every run,
    on CPU (`index_add_`, one add after another) and CUDA (`index_put_` with `accumulate`,
    sort-based). On CUDA nothing waits for the device (no host sync)."""
    return _add_token_rows(out, rows, grads, valid, host_checks=not out.is_cuda)


def _add_token_rows(
    out: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    valid: torch.Tensor | None,
    host_checks: bool,
) -> torch.Tensor:
    """`add_token_rows`; `host_checks` says whether reading a tensor's value on the host is
    free (CPU). Without (CUDA), every shape stays `n`; tests run that path on CPU too."""
    num_rows, n = out.shape[0], rows.numel()
    if num_rows == 0 or n == 0:
        return out
    if valid is None:
        valid = rows < num_rows
    if host_checks:
        # Drop the skipped tokens rather than copy every token's gradient through a mask
        # (on CPU the copy took longer than the add itself).
        if not bool(valid.all()):
            keep = valid.nonzero().squeeze(1)
            rows, grads = rows[keep], grads[keep]
        index, values = rows, grads
    else:
        # torch.where, not boolean indexing. Skipped tokens add zeros, to rows spread over
        # the table: a long run of one index would serialize CUDA's accumulate.
        values = torch.where(valid.unsqueeze(1), grads, 0)
        index = torch.where(valid, rows, torch.arange(n, device=rows.device) % num_rows)
    if out.dtype in (torch.float32, torch.float64):
        _accumulate(out, index, values.to(out.dtype))
        return out
    if host_checks:
        unique, inverse = torch.unique(index, return_inverse=True)
    else:
        # torch.unique's size needs a host sync. Instead: segments of the sorted rows, one
        # per distinct row (token order kept inside each), `n` of them at most; the unused
        # ones sum to zero on rows spread over the table, and adding zero changes nothing.
        sorted_rows, order = torch.sort(index, stable=True)
        starts = torch.ones_like(sorted_rows, dtype=torch.bool)
        starts[1:] = sorted_rows[1:] != sorted_rows[:-1]
        segment = torch.cumsum(starts, 0) - 1
        unique = (torch.arange(len(segment), device=out.device) % num_rows).scatter_(
            0, segment, sorted_rows
        )
        inverse = torch.empty_like(segment).scatter_(0, order, segment)  # each token's segment
    sums = torch.zeros(unique.numel(), out.shape[1], dtype=torch.float32, device=out.device)
    _accumulate(sums, inverse, values.float())
    return out.index_put_((unique,), sums.to(out.dtype), accumulate=True)  # one add per row


def _accumulate(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    # CPU index_put_ with accumulate adds from several threads in no fixed order; CUDA
    # index_add_ uses atomics. Each device's deterministic one:
    if out.is_cuda:
        out.index_put_((index,), values, accumulate=True)
    else:
        out.index_add_(0, index, values)


def sum_touched_rows(
    grad: torch.Tensor | GatheredRows,
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    rows: torch.Tensor | None = None,
    union: RowUnion | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """The sum over `group` of every rank's `grad` `[num_rows, h]` (or its rows gathered
    by `union.gather`).

    `rows` (int64 `[n]`, repeats allowed, `num_rows` standing for none), if given, holds
    every row where this rank's `grad` may be nonzero. `union`, if given, is a union every
    rank started earlier (from predicted rows). Returns `(index, values)`: `values` `[u, h]`
    (in `dtype`) are the sums of the rows `index` `[u]`, every other row summing to zero;
    `index` is None when `values` is the whole table; None when every rank's gradient is
    zero. The result is the same on every rank, bit for bit, and so is the sequence of
    collectives.
    """
    if not isinstance(grad, GatheredRows) and grad.dim() != 2:
        raise ValueError(
            f"tpcore: sum_touched_rows: expected a [rows, h] gradient, got shape {list(grad.shape)}"
        )
    if union is not None:
        outside = rows is None or not union.covers(rows)
        result, anyone_outside = _sum_rows(grad, union.index(), group, dtype, outside)
        if not anyone_outside:
            return result
    if isinstance(grad, GatheredRows):  # another rank's rows were not predicted: rare
        grad = grad.dense()
    result, _ = _sum_rows(
        grad, RowUnion(grad.shape[0], group, rows=rows, grad=grad).index(), group, dtype, None
    )
    return result


def _sum_rows(
    grad: torch.Tensor | GatheredRows,
    index: torch.Tensor,
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    flag: bool | None,
) -> tuple[tuple[torch.Tensor | None, torch.Tensor] | None, bool]:
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
