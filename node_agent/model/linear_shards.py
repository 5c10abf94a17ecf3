"""One rank's part of a tensor-parallel model's Linear layers, for the layers the node's own loaders
fill (node_agent/model/gguf_loader.py, quantized_checkpoint.py: quantized weights, read tensor by
tensor) and for full-precision shards quantized at load (quantized_linear.quantize). The split is
transformers' TP plan (the config's `base_model_tp_plan`): a "colwise" layer holds its rank's slice
of the output rows (q, k, v, gate, up: the attention then runs its rank's heads), a "rowwise" one
its slice of the input columns (o, down), whose partial products are summed over the ranks
(all-reduce) before its bias is added once, as transformers' RowwiseParallel does for a dense layer.

Each tensor is cut before it is packed, so a rank never holds another rank's part: 4-bit codes and
their group scales together, cut on group boundaries; 8-bit codes with their per-row scales. A cut
that would split a 4-bit group, or leave a rank rows that are no whole tile of the int4 kernels, is
refused (ModelLoadError). Everything else (embeddings, norms, the output head) is replicated."""

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DTensorShard
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

from shared.model_files import ModelLoadError
from shared.weight_formats import GROUP, OUT_MULTIPLE

COLWISE, ROWWISE = "colwise", "rowwise"
_REPLICATED = (
    "replicated_with_grad_allreduce",
    "replicate",
)  # styles that keep a module whole (qwen3's q/k norms)


class Shard(NamedTuple):
    """Rank `rank` of `ranks`' part of the Linear layer `name`, split `style` ("" : whole)."""

    name: str = ""
    style: str = ""
    rank: int = 0
    ranks: int = 1

    def outputs(self, n: int, per: int = 1) -> slice:
        """This rank's rows of `n` outputs (all of them unless colwise), in whole runs of `per`."""
        return self._cut(n, per, "rows", "output rows") if self.style == COLWISE else slice(None)

    def inputs(self, n: int, per: int = 1) -> slice:
        """This rank's columns of `n` inputs (all of them unless rowwise), in whole runs of `per`."""
        return self._cut(n, per, "columns", "inputs") if self.style == ROWWISE else slice(None)

    def _cut(self, n: int, per: int, what: str, unit: str) -> slice:
        share = n // self.ranks
        if n % self.ranks or share % per:
            why = (
                "do not come out even"
                if n % self.ranks
                else f"splits a 4-bit group of {per} inputs"
                if unit == "inputs"
                else f"splits the int4 kernels' tiles of {per} rows"
            )
            raise ModelLoadError(
                f"{self.name} cannot be split over {self.ranks} ranks: its {n} {unit} cut into "
                f"{what} of {n / self.ranks:g}, which {why}; run it with fewer ranks"
                + (" or quant = 'none'" if per > 1 else "")
            )
        return slice(self.rank * share, (self.rank + 1) * share)

    def int4(
        self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """A 4-bit layer's codes [out, in] and per-group scale and zero [out, in / GROUP], this rank's part."""
        rows = self.outputs(codes.shape[0], OUT_MULTIPLE)
        columns = self.inputs(codes.shape[1], GROUP)
        groups = (
            slice(None)
            if columns.start is None
            else slice(columns.start // GROUP, columns.stop // GROUP)
        )
        return codes[rows, columns].contiguous(), scale[rows, groups], zero[rows, groups]

    def int8_groups(
        self, codes: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An 8-bit grouped layer's codes [out, in] and per-group scale [out, in / GROUP], this rank's
        part (cut as a 4-bit layer's: it runs as two)."""
        codes, scale, _ = self.int4(codes, scale, scale)
        return codes, scale

    def int8(self, codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An 8-bit layer's codes [out, in] and per-row scale [out], this rank's part."""
        rows, columns = self.outputs(codes.shape[0]), self.inputs(codes.shape[1])
        return codes[rows, columns].contiguous(), scale[rows]

    def dense(self, attr: str, value: torch.Tensor) -> torch.Tensor:
        """A dense `weight` [out, in] or `bias` [out] of the layer, this rank's part (a row-parallel
        layer's bias whole: it is added once, after the sum)."""
        if attr == "weight" and value.dim() == 2:
            return value[self.outputs(value.shape[0]), self.inputs(value.shape[1])].contiguous()
        return value[self.outputs(value.shape[0])].contiguous() if attr == "bias" else value


WHOLE = Shard()


class Plan(NamedTuple):
    """Which Linear layers of a model split, and how, for this rank."""

    styles: dict[
        str, str
    ]  # plan key (layer numbers as "*", without the base model's prefix) -> style
    prefix: str  # the base model's attribute ("model.")
    rank: int
    ranks: int

    @classmethod
    def of(cls, model: torch.nn.Module, ranks: int) -> "Plan":
        """The plan of `model` (built, not yet filled) for this process's rank of `ranks`; a plan
        that splits nothing with one rank."""
        styles = dict(model.config.get_text_config().base_model_tp_plan or {}) if ranks > 1 else {}
        odd = {
            key: style
            for key, style in styles.items()
            if style not in (COLWISE, ROWWISE, *_REPLICATED)
        }
        if odd:
            key, style = next(iter(odd.items()))
            raise ModelLoadError(
                f"quantized weights split 'colwise' and 'rowwise' layers only; {key} is '{style}' in "
                f"{model.config.model_type}'s tensor-parallel plan"
            )
        return cls(
            styles, f"{model.base_model_prefix}.", dist.get_rank() if ranks > 1 else 0, ranks
        )

    def shard(self, module_name: str) -> Shard:
        """The part of module `module_name` this rank holds (WHOLE where the plan does not split it)."""
        style = self.styles.get(
            replace_layer_number_by_wildcard(module_name.removeprefix(self.prefix)), ""
        )
        return (
            Shard(module_name, style, self.rank, self.ranks)
            if style in (COLWISE, ROWWISE)
            else WHOLE
        )

    def sum_rows(self, model: torch.nn.Module) -> None:
        """Wrap each row-parallel layer of a filled model so that it sums its partial product over the ranks."""
        for name, module in list(model.named_modules()):
            if self.shard(name).style == ROWWISE:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, RowParallel(module))


class RowParallel(torch.nn.Module):
    """A row-parallel layer: its rank's partial product, summed over the ranks, then its bias (taken
    from the layer, which then adds none)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        bias = layer.bias
        layer.bias = None
        self.layer = layer
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


def local(linear: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """A Linear that transformers' TP sharded (DTensor parameters): this rank's weight and bias as
    plain tensors, and whether it is row-parallel (its weight split by input columns). A Linear
    that is not sharded comes out as it is."""
    weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    if not isinstance(weight, DTensor):
        return weight, bias, False
    rowwise = weight.placements[0] in (DTensorShard(1), DTensorShard(-1))
    return (
        weight.to_local(),
        None if bias is None else bias.to_local(),
        rowwise,
    )  # (a row-parallel bias: whole)
