"""Stream the activations of chosen layers into one float64 :class:`~rank_lightning.metrics.ActivationSpectrum` each.

:class:`ActivationStream` is the part of activation monitoring that knows nothing of Lightning: forward hooks on the
chosen layers, the hidden state of each layer's output (:func:`~rank_lightning.layers.hidden_state`), the batch and
token layout, padded tokens (the batch's attention mask; in the decoder of an encoder-decoder model, the
decoder's own: :func:`~rank_lightning.layers.decoder_layers`), how many rows of each batch are measured (at most
``max_samples``, never the samples a ``DistributedSampler`` repeats: :mod:`rank_lightning.sampling`), a memory
budget over all layers, and the collective ``compute`` that every process joins. The Lightning callback
:class:`~rank_lightning.callbacks.ActivationRankMonitor` decides *when* a pass runs; the plain-PyTorch
:class:`~rank_lightning.tracker.RankTracker` lets the user's own loop decide. Both give the same numbers on the same
batches because both run this code.

A pass::

    stream.start(model, num_batches=len(loader))
    for batch in loader:
        stream.batch_start(batch)      # labels, mask and batch size of this batch
        model(inputs)                  # the hooks stream every chosen layer's output
        stream.batch_end()
    values = stream.compute(device)    # {layer: {key: value}}; a collective under DDP; resets the sums
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rank_lightning.functional.reductions import check_token_mask, token_mask
from rank_lightning.functional.streaming import (
    IGNORE_INDEX,
    ClassGrouping,
    group_by_class,
    group_token_labels,
    reduced_float32_format,
)
from rank_lightning.layers import (
    DECODER_MASK_KEY,
    MASK_KEY,
    BatchReader,
    FeatureLayer,
    OutputSelector,
    check_label_rows,
    class_labels,
    decoder_layers,
    expert_layers,
    forward_hooks,
    hidden_state,
    key_advice,
    several_loaders_advice,
    unmasked_layers,
)
from rank_lightning.metrics import ActivationSpectrum
from rank_lightning.sampling import CombinedOwnRows, own_samples, process_share
from rank_lightning.validation import count_of, mib_text

__all__ = ["REPEATED_CALLS", "ActivationStream", "in_backward"]
# What a layer called more than once per batch gives: its first call, or each call as a layer of its own.
REPEATED_CALLS = ("first", "each")
_KINDS = {4: "conv maps", 3: "tokens"}
_MAX_NDIM = 5  # conv maps of up to three spatial dimensions: (B, C, D1, D2, D3) of a Conv3d
_MIB = 2**20
_FLOAT64_BYTES = 8
# How ActivationSpectrum.compute starts its warning about class Grams that its budget left out.
_NO_CLASS_GRAMS = "ActivationSpectrum: the class-wise variance ratio is not computed"
_MORE_MEMORY = (
    "The spectrum of every layer comes first, then the class Grams, the smallest first (the plan printed after the "
    "first monitored batch names the layers that have them). Raise memory_budget_mb, or leave "
    "'classwise_variance_ratio' out of metrics."
)


def _kind(ndim: int) -> int:
    """The key of ``reductions`` for outputs of ``ndim`` dimensions: ``4`` for conv maps of any spatial dimensions
    (``(B, C, H, W)``, ``(B, C, D1, D2, D3)``), else ``ndim``."""
    return min(ndim, 4)


def _token_positions(batch: Any, size: int | None, *masks: Tensor | None) -> frozenset[int]:
    """The token positions ``T`` of a batch of ``size`` sequences: the second dimension of its ``(B, T)`` masks and of
    the ``(B, T)`` integer tensors it holds (token ids, labels per token)."""
    if size is None:
        return frozenset()
    items = list(batch.values()) if isinstance(batch, Mapping) else batch
    items = items if isinstance(items, (tuple, list)) else [items]
    tokens = [item for item in items if isinstance(item, Tensor) and not item.is_floating_point()]
    found = (t for t in (*tokens, *masks) if isinstance(t, Tensor) and t.ndim == 2 and t.shape[0] == size)
    return frozenset(t.shape[1] for t in found)


def _flattened_tokens(shape: tuple[int, ...], batch: int) -> str:
    """Why a ``(B * T, d)`` output of a batch of ``B`` sequences of ``T`` tokens is skipped."""
    return (
        f"gives {shape} from a batch of {batch} sequences of {shape[0] // batch} tokens: the batch's {shape[0]} "
        "token positions flattened into rows (a mixture-of-experts router or fused experts layer reads (B, T, D) "
        "as (B * T, D)), neither one row per input nor views of the batch; it is skipped. Monitor the block that "
        "returns (B, T, D) (the sparse MoE block), or measure these rows as they come with unbatched=True in a "
        "monitor of its own (every position, padded ones included; no class metrics)."
    )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class ActivationStream:
    """Hooks on chosen layers that stream their activations, one pass at a time, into per-layer spectra.

    Args:
        layers: ``logged name -> module path`` of the layers to hook, in depth order.
        num_classes: classes of the labels; ``None`` skips the class metrics.
        reductions: reduction of conv (``4``) and token (``3``) outputs, e.g. ``{4: "channel", 3: "token"}``; the
            conv reduction serves the 5-D maps ``(B, C, D1, D2, D3)`` of 3-D convolutions too.
        spectrum_options: the :class:`~rank_lightning.metrics.ActivationSpectrum` settings every layer shares.
        batch_reader: where labels and the attention mask are in a batch. Under its default mask lookup
            (:attr:`~rank_lightning.layers.BatchReader.default_mask_lookup`) the token layers in the decoder of a
            encoder-decoder model (:func:`~rank_lightning.layers.decoder_layers`, found at :meth:`start`) read
            the batch's ``decoder_attention_mask``, the layers in an image tower of a Hugging Face model, which takes no
            attention mask (:func:`~rank_lightning.layers.unmasked_layers`), no mask, the others its
            ``attention_mask``; a batch with an attention mask but no decoder mask measures those layers whole, with a
            warning naming each, and so does a batch with no mask whose ``labels`` hold -100 (padded targets).
        layouts: ``logged name -> batch_first`` for token layers whose layout is known; others are learnt from a
            batch whose shape tells it (the batch size in exactly one leading dimension).
        ambiguous_layouts: ``logged name -> batch_first`` for a batch whose shape cannot tell (as many sequences as
            tokens), where the model's kind says it (:func:`~rank_lightning.layers.batch_first_when_ambiguous`);
            other layers skip such a batch with a warning.
        channel_maps: ``logged name -> C`` (or ``None``) of the layers whose 3-D outputs are 1-d conv maps
            ``(B, C, L)`` (:func:`~rank_lightning.layers.channel_first_layers`): read as ``(B, C, L, 1)`` conv maps,
            reduced by the conv reduction (``reductions[4]``), unless ``C`` is the output's last dimension and not its
            second (a block that transposes its maps back to tokens, ``(B, L, C)``).
        channels_last: ``logged name -> (token widths, all widths)`` of the layers whose 4-D or 5-D outputs may be
            channels-last ``(B, H, W, C)`` / ``(B, D1, D2, D3, C)``
            (:func:`~rank_lightning.layers.channels_last_layers`): such an output whose last dimension is a token
            width and whose second is no width is permuted to ``(B, C, H, W)`` / ``(B, C, D1, D2, D3)`` before the
            conv reduction, so that ``C`` (not ``H``) is what ``channel`` and ``mean`` keep.
        output_selector: which tensor of a layer's output is its hidden state (see
            :func:`~rank_lightning.layers.hidden_state`).
        max_samples: inputs per pass, spread evenly over the pass's batches; ``None`` for all.
        memory_budget_mb: total memory the states of all layers may take on a device, given out by priority: first
            every layer's spectrum (its exact Gram while it fits in what is left, else the subsample fallback within
            an even share of what is left among the layers not planned yet; one whose fallback does not fit either
            raises before anything is allocated), then, once the batch that called them ends, the class Grams of the
            class-wise variance ratio: the layers whose class Grams are smallest first, each within an even share of
            what the spectra leave (:meth:`_plan_class_grams`). A layer never loses its exact Gram to the class Grams
            of another.
        warn: ``warn(layer, kind, message)``, called for every per-layer problem (once per layer and kind is the
            caller's choice).
        info: ``info(message)``, called once with the planned state size after the first batch.
        repeated_calls: a layer called more than once per batch (a block applied N times): ``"first"`` measures its
            first call of each batch, with a warning; ``"each"`` measures its ``k``-th call of each batch as a layer
            of its own, ``<layer>@<k>`` (``<layer>@1`` its first), placed after the layer in depth order and planned
            in the memory budget as a layer. A batch that calls it another number of times than the pass's first is
            named in a warning, and the ``k``-th application sums the rows of the batches that made at least ``k``
            calls; under DDP the applications some processes did not run are named in a warning and not logged.
        unbatched: read every layer's output as rows with no batch dimension: all ``N`` rows of a ``(N, d)`` output,
            whatever ``N`` (the tokens routed to an expert, a router's logits over the batch's flattened positions),
            with no mask and no labels; a batch to which ``max_samples`` gives no input gives no rows. Without it,
            the layers at or inside a routed expert (:func:`~rank_lightning.layers.expert_layers`) are skipped with a
            warning, and so is a ``(B * T, d)`` output of a batch of ``B`` sequences of ``T`` tokens.
    """

    def __init__(
        self,
        layers: Mapping[str, str],
        *,
        num_classes: int | None,
        reductions: Mapping[int, str],
        spectrum_options: Mapping[str, Any],
        batch_reader: BatchReader,
        layouts: Mapping[str, bool] | None = None,
        ambiguous_layouts: Mapping[str, bool] | None = None,
        channel_maps: Mapping[str, int | None] | None = None,
        channels_last: Mapping[str, tuple[frozenset[int], frozenset[int]]] | None = None,
        output_selector: OutputSelector | None = None,
        max_samples: int | None = None,
        memory_budget_mb: float | None = None,
        warn: Callable[[str, str, str], None] | None = None,
        info: Callable[[str], None] | None = None,
        repeated_calls: str = "first",
        unbatched: bool = False,
    ) -> None:
        self.layers = dict(layers)
        self.repeated_calls = repeated_calls
        self.unbatched = unbatched
        # The applications after the first of the layers called more than once per batch (repeated_calls="each"):
        # ``<layer>@<k> -> (layer, k)``, k >= 2; and the most calls of each layer in a batch of the current pass.
        self._applications: dict[str, tuple[str, int]] = {}
        self._most_calls: dict[str, int] = {}
        self.num_classes = num_classes
        self.reductions = dict(reductions)
        self.spectrum_options = dict(spectrum_options)
        self.batch_reader = batch_reader
        self.layouts = dict(layouts or {})
        self.ambiguous_layouts = dict(ambiguous_layouts or {})
        self.channel_maps = dict(channel_maps or {})
        self.channels_last = dict(channels_last or {})
        self._channels_last_named: set[str] = set()  # the layers whose channels-last reading was said
        self.output_selector = output_selector
        self.max_samples = max_samples
        self.memory_budget_mb = memory_budget_mb
        self.memory_budget_bytes = None if memory_budget_mb is None else int(memory_budget_mb * _MIB)
        self._warn = warn or _default_warn
        self._info = info or (lambda message: None)
        self.metrics: dict[str, ActivationSpectrum] = {}
        self.layer_ndims: dict[str, int] = {}
        self._decoder_layers: frozenset[str] = frozenset()  # the layers that read the decoder's mask
        self._unmasked_layers: frozenset[str] = frozenset()  # the layers that no mask of the batch belongs to
        self._expert_layers: frozenset[str] = frozenset()  # the layers called on the tokens routed to an expert
        self._planned: dict[str, int] = {}
        self._reported_plan: dict[str, int] = {}  # printed once, and again only if layers are added
        # The layers whose class Grams are decided at the end of the batch that first called them: their width, and
        # their metric with class Grams and its bytes. Once decided, why a layer has none (None: it has them).
        self._undecided: dict[str, tuple[int, ActivationSpectrum, int]] = {}
        self._class_grams: dict[str, str | None] = {}
        self._max_samples_reached = False
        self._hooks = ExitStack()
        self._clear_pass()
        self._clear_notes()

    def _clear_pass(self) -> None:
        self.active = self._in_batch = False
        self.remaining: int | None = None
        self._batches_left: float = math.inf
        self._batch: int | None = None
        self._batch_told = "the batch"  # what told the batch size: the batch, or its labels or mask
        self._take: int | None = None
        self._labels: Tensor | None = None
        self._groupings: dict[torch.device, ClassGrouping] = {}
        self._token_groupings: dict[torch.device, ClassGrouping] = {}
        self._mask: Tensor | None = None
        self._decoder_mask: Tensor | None = None
        self._positions: frozenset[int] = frozenset()  # the token positions T of the batch's (B, T) inputs and masks
        self._cls_counted: set[bool] = set()  # the masks whose left padding the current batch counted
        self._seen_this_batch: set[str] = set()
        self._calls_in_batch: dict[str, int] = {}  # the calls of each layer in the current batch
        self._first_calls: dict[str, int] | None = None  # those of the pass's first batch (repeated_calls="each")
        # The first rows of the layers whose class Grams are not decided yet, held until the batch ends.
        self._held: dict[str, tuple[Tensor, ClassGrouping | Tensor | None, Tensor | None]] = {}
        self._own_left: list[int | None] = []
        self._combined_own: dict[int, CombinedOwnRows] = {}  # per loader index: a collection whose loaders repeat
        self._own_rows: int | None = None
        self._own_indices: list[int] | None = None  # a combined batch's rows that are the process's own (None: all)
        self._own_index_tensors: dict[torch.device, Tensor] = {}
        self._own_loader = 0
        self._offered_left: int | None = None
        self._name_uncalled = True
        self.batches_seen = self.inputs_measured = 0

    # -- a pass ---------------------------------------------------------------------------------------------------

    def start(
        self,
        module: nn.Module,
        *,
        num_batches: float = math.inf,
        world_size: int = 1,
        rank: int = 0,
        loaders: Sequence[Any] = (),
        name_uncalled: bool = True,
    ) -> None:
        """Hook the layers of ``module`` for a pass of ``num_batches`` batches (``inf`` when unknown); clears the
        sums of an earlier pass cut short.

        ``loaders`` are the loaders of the pass, in the order of the ``loader`` index given to :meth:`batch_start`:
        the samples a ``DistributedSampler`` repeats at the end of one (:func:`~rank_lightning.sampling.own_samples`)
        are not measured, so that the processes together measure each sample once; a collection of loaders (a list or
        dict, whose batches are combined) leaves out the repeats of each of its loaders
        (:class:`~rank_lightning.sampling.CombinedOwnRows`). ``name_uncalled=False`` does not
        warn about layers the pass's first batch did not run (a pass whose forward is not the module's own steps).
        """
        self.stop()
        self._clear_notes()
        for metric in self.metrics.values():
            metric.reset()
        # The shares of the processes (``rank`` of ``world_size``) add up to max_samples; the largest share says when
        # every process has offered enough rows (the same batch on every process, see ``exhausted``).
        self._most_calls = {}
        self.remaining = process_share(self.max_samples, world_size, rank)
        self._offered_left = process_share(self.max_samples, world_size, 0)
        self._batches_left = num_batches if num_batches > 0 else math.inf
        layers = [FeatureLayer(name, path) for name, path in self.layers.items()]
        # A decoder's tokens are the target's: the batch's attention_mask (the encoder's) is not theirs, even when
        # source and target are padded to one length. A mask_key of the user's own is every layer's.
        reads_decoder_mask = self.batch_reader.default_mask_lookup
        self._decoder_layers = frozenset(decoder_layers(module, self.layers) if reads_decoder_mask else ())
        # An image tower's patches are not the text's tokens: the batch's attention_mask is not theirs either.
        self._unmasked_layers = frozenset(unmasked_layers(module, self.layers) if reads_decoder_mask else ())
        self._expert_layers = frozenset(expert_layers(module, self.layers))
        self._hooks.enter_context(forward_hooks(module, layers, self._hook))
        self._own_left = [None if _collection(loader) else own_samples(loader) for loader in loaders]
        combined = {index: CombinedOwnRows(loader) for index, loader in enumerate(loaders) if _collection(loader)}
        self._combined_own = {index: rows for index, rows in combined.items() if rows.repeats}
        self._name_uncalled = name_uncalled
        self.active = True

    def _clear_notes(self) -> None:
        """Forget what the pass noted for the warnings of its end, which stays, as the sums do, until :meth:`compute`
        or :meth:`start` (a ``RankTracker`` block ends, and stops the pass, before ``compute()`` is called)."""
        self._wrong_masks: Tensor | None = None  # batches whose masks held values other than 0 and 1, on the device
        self._left_padded: dict[bool, bool] = {}  # whether the pass's first batch pads on the left, per decoder flag
        # Later batches, read at the end of the pass: left-padded batches on the device and the 'cls' layers of each
        # mask, per decoder flag.
        self._left_padded_later: dict[bool, Tensor] = {}
        self._cls_layers: dict[bool, set[str]] = {}
        # Batches without any mask whose labels hold -100 (padded targets), on the device, and the decoder layers
        # measured whole in them: read at the end of the pass.
        self._padded_targets: Tensor | None = None
        self._whole_decoder_layers: set[str] = set()
        # Per layer: the half precision its float32 outputs carry the rounding of (reduced_precision), None if none.
        self._autocast: dict[str, tuple[torch.dtype, str] | None] = {}

    def stop(self) -> None:
        """Remove the hooks and forget the pass's counters (the sums, and what the pass noted for the warnings of its
        end, stay until :meth:`compute` or :meth:`start`)."""
        self._hooks.close()
        self._clear_pass()

    def pause(self) -> None:
        """Ignore forward passes until the next :meth:`batch_start` (e.g. a validation run inside a training
        window, or another callback's extra forward passes)."""
        self._in_batch = False

    @property
    def between_batches(self) -> bool:
        """Whether no batch is open: every batch begun so far has ended (:meth:`batch_end`)."""
        return not self._in_batch

    def pass_state(self) -> dict[str, Any]:
        """What the pass has streamed so far, for a checkpoint, so that another process continues the pass where this
        one is (:meth:`resume`): the states of every layer that got rows (on the CPU: float64, a d x d Gram is
        ``8 d^2`` bytes, plus the class Grams with class metrics), its output's dimensions and updates, and the
        pass's counters (batches seen, rows measured and still to take). Call it between batches."""
        layers = {}
        for name, metric in self.metrics.items():
            if not metric.update_count:
                continue
            metric.persistent(True)
            try:
                saved = metric.state_dict()
            finally:
                metric.persistent(False)
            states = {key: _on_cpu(value) for key, value in saved.items()}
            layers[name] = {"ndim": self.layer_ndims.get(name, 2), "updates": metric.update_count, "states": states}
        return {
            "layers": layers,
            "batches_seen": self.batches_seen,
            "inputs_measured": self.inputs_measured,
            "remaining": self.remaining,
            "offered_left": self._offered_left,
            "batches_left": float(self._batches_left),
            # The own rows left of each loader that repeats samples (a DistributedSampler's), and of a collection's.
            "own_left": list(self._own_left),
            "combined_read": {index: list(rows.read) for index, rows in self._combined_own.items()},
        }

    def resume(
        self, module: nn.Module, state: Mapping[str, Any], device: torch.device | str, *, loaders: Sequence[Any] = ()
    ) -> None:
        """Start a pass of ``module`` over ``loaders`` (as :meth:`start` takes them) that continues the one
        :meth:`pass_state` returned ``state`` of: its layers' states on ``device`` and its counters, so that the
        batches still to come end it as they would have ended the saved one. Under DDP each process continues its
        own pass (each streams batches of its own).

        Raises:
            ValueError: a saved layer this stream does not monitor.
            RuntimeError: saved states that its metric cannot take (another width, path or number of classes).
        """
        self.start(module, num_batches=state["batches_left"], loaders=loaders)
        created: list[str] = []  # the layers planned here, forgotten again if the pass cannot go on
        try:
            for name, saved in state["layers"].items():
                if name not in self.layers and not self._saved_application(name):
                    raise ValueError(f"the saved pass measured layer {name!r}, which is not monitored now")
                ndim, states = int(saved["ndim"]), dict(saved["states"])
                metric = self.metrics.get(name)
                if metric is None:
                    options = dict(self.spectrum_options, reduction=self.reductions.get(_kind(ndim)) or "flatten")
                    created.append(name)
                    metric = self._within_budget(name, int(states["feature_sum"].shape[0]), options)
                    metric = self._resumed_class_grams(name, metric, states)
                metric.load_state_dict(states)
                self.metrics[name] = metric.to(device)
                metric._update_count = max(metric.update_count, int(saved["updates"]))
                self.layer_ndims[name] = ndim
            self.batches_seen, self.inputs_measured = int(state["batches_seen"]), int(state["inputs_measured"])
            self.remaining, self._offered_left = state["remaining"], state["offered_left"]
            own_left = state.get("own_left", [])
            if len(own_left) == len(self._own_left):
                self._own_left = list(own_left)
            for index, read in state.get("combined_read", {}).items():
                if index in self._combined_own:
                    self._combined_own[index].read = list(read)
        except BaseException:
            for name in created:
                for planned in (self.metrics, self._planned, self.layer_ndims):
                    planned.pop(name, None)
            for metric in self.metrics.values():
                metric.reset()
            self.stop()
            raise

    def _resumed_class_grams(
        self, name: str, metric: ActivationSpectrum, states: Mapping[str, Any]
    ) -> ActivationSpectrum:
        """The metric a resumed layer continues in: with class Grams where the saved pass had them (the plan that pass
        made at the end of its first batch, :meth:`_plan_class_grams`, which a pass resumed between batches does not
        make again), without them where it had none."""
        undecided = self._undecided.pop(name, None)
        if undecided is None:
            return metric
        _, with_grams, planned = undecided
        saved = states.get("class_grams")
        if isinstance(saved, Tensor) and saved.numel():
            self._planned[name], self._class_grams[name] = planned, None
            return with_grams
        self._class_grams[name] = "the pass this fit continues had none (saved in the checkpoint's open window)"
        return metric

    @property
    def exhausted(self) -> bool:
        """Whether the batches so far offered the largest process share of ``max_samples``: where a pass of unknown
        length may stop. Every process reaches it at the same batch (equal batch sizes), so a forward pass that is
        itself a collective (FSDP, DeepSpeed ZeRO-3) runs as often on each, whatever its own share."""
        return self._offered_left is not None and self._offered_left <= 0

    def batch_start(
        self,
        batch: Any = None,
        *,
        labels: Tensor | None = None,
        mask: Tensor | None = None,
        decoder_mask: Tensor | None = None,
        loader: int = 0,
        combined: bool = False,
    ) -> None:
        """Begin a batch: its labels (``labels`` or read from ``batch``), its attention mask (``mask`` or read from
        ``batch``), the mask of the decoder's tokens for the layers in the decoder of an encoder-decoder
        (``decoder_mask`` or read from ``batch``) and its size, which tells the batch dimension of every layer's
        output; ``loader`` is the index of the batch's loader among the ``loaders`` of :meth:`start`. ``combined``:
        the batch holds the batches of several loaders (Lightning's ``CombinedLoader``), whose first tensor is one
        loader's: its size is then told by the labels or mask, else by the layers' outputs."""
        if labels is None and batch is not None and self.num_classes:
            labels = self._read_labels(batch)
        elif labels is not None and self.num_classes:
            labels = class_labels(labels, per_token=True)
        self._labels = labels if self.num_classes else None
        if self._labels is not None and self.batches_seen == 0:
            self._check_shifted(batch, self._labels)
        self._mask, wrong = self._read_mask(batch, mask, self.batch_reader.mask)
        self._decoder_mask, wrong_decoder = None, None
        if self._decoder_layers:
            self._decoder_mask, wrong_decoder = self._read_mask(batch, decoder_mask, self.batch_reader.decoder_mask)
        self._count_wrong_masks(wrong, wrong_decoder)
        if self._decoder_layers and self._mask is None and self._decoder_mask is None:
            self._count_padded_targets(batch)
        self._batch = BatchReader.batch_size(batch) if batch is not None and not combined else None
        if self._batch is not None and isinstance(self._labels, Tensor):
            # Labels cut or padded to the rows of a layer would pair its rows with other classes.
            check_label_rows(self._labels, self._batch, "its inputs")
        self._own_indices, self._own_index_tensors = None, {}
        if combined and batch is not None and loader in self._combined_own:
            self._batch, self._own_indices = self._combined_own[loader].rows(batch, BatchReader.batch_size)
        self._batch_told = "the batch"
        for known, told in zip((labels, self._mask, self._decoder_mask), ("its labels", "its mask", "its mask")):
            if self._batch is None and isinstance(known, Tensor) and known.ndim:
                # Labels tell the batch size even without class metrics.
                self._batch, self._batch_told = known.shape[0], told
        self._positions = _token_positions(batch, self._batch, self._mask, self._decoder_mask)
        self._own_loader = loader
        self._own_rows = self._count_own(loader) if self._batch is not None else None
        if self._own_indices is not None:
            self._own_rows = len(self._own_indices)
            keep = torch.tensor(self._own_indices, dtype=torch.long)
            # The labels and masks of the rows measured: the process's own, in order.
            self._labels = _rows_of(self._labels, keep, self._batch)
            self._mask, self._decoder_mask = (
                _rows_of(self._mask, keep, self._batch),
                _rows_of(self._decoder_mask, keep, self._batch),
            )
        if self._offered_left is not None and self._batch is not None:
            self._offered_left -= self._batch
        self._take = None
        self._groupings, self._token_groupings = {}, {}
        self._seen_this_batch = set()
        self._calls_in_batch = {}
        self._cls_counted = set()
        self._in_batch = True

    def _check_shifted(self, batch: Any, labels: Tensor) -> None:
        """At a pass's first batch, warn when labels per token equal the batch's ``input_ids`` wherever they are not
        -100: Hugging Face's causal LM ``labels``, which the model shifts inside its loss, taken unshifted would give
        each token row its own token as class instead of the next one."""
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if not (isinstance(labels, Tensor) and labels.ndim == 2 and isinstance(ids, Tensor)):
            return
        if ids.shape != labels.shape or ids.is_floating_point():
            return
        labelled = labels != IGNORE_INDEX
        if bool(((labels == ids.to(labels.device)) | ~labelled).all() & labelled.any()):
            message = (
                "the labels per token equal the batch's 'input_ids' wherever they are not -100: the labels of a "
                "Hugging Face causal LM, which the model shifts inside its loss. Taken as they are, each token's class "
                "is the token itself, not the next one; shift them for next-token classes, e.g. label_fn=lambda b: "
                "torch.cat([b['labels'][:, 1:], torch.full_like(b['labels'][:, :1], -100)], 1)."
            )
            self._warn("", "unshifted labels", message)

    def _read_mask(
        self, batch: Any, mask: Tensor | None, read: Callable[..., Tensor | None]
    ) -> tuple[Tensor | None, Tensor | None]:
        """A mask of the batch (``mask``, else ``read(batch)``: the reader's ``mask`` or ``decoder_mask``) as
        booleans, and after a pass's first batch whether it holds other values than 0 and 1 (on its device).

        Its values are checked at a pass's first batch, where a mask of other values than 0 and 1 raises; after that
        the check runs on the mask's device and is read at the end of the pass (:meth:`compute` warns), so that a
        monitored batch on a GPU does not wait for it.
        """
        if mask is None and batch is not None:
            mask = read(batch, convert=self.batches_seen == 0)
        if not isinstance(mask, Tensor) or mask.dtype == torch.bool:
            return mask, None  # anything but a tensor: the layers' check names it
        if self.batches_seen == 0:
            return token_mask(mask), None
        return mask != 0, ((mask != 0) & (mask != 1)).any()

    def _count_wrong_masks(self, *flags: Tensor | None) -> None:
        """Count the batch, on the device, when one of its masks held values other than 0 and 1."""
        found = [flag for flag in flags if flag is not None]
        if not found:
            return
        wrong = found[0]
        for flag in found[1:]:
            wrong = wrong | flag.to(wrong.device)
        wrong = wrong.to(torch.int64)
        self._wrong_masks = wrong if self._wrong_masks is None else self._wrong_masks + wrong.to(self._wrong_masks)

    def _count_padded_targets(self, batch: Any) -> None:
        """Count, on the device, a batch with no mask whose ``labels`` hold -100: Hugging Face's padding of the
        targets, whose decoder positions are then measured whole (:meth:`compute` warns)."""
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if not isinstance(labels, Tensor) or labels.ndim != 2 or labels.is_floating_point() or labels.is_complex():
            return
        padded = (labels == -100).any().to(torch.int64)
        counted = self._padded_targets
        self._padded_targets = padded if counted is None else counted + padded.to(counted.device)

    def _warn_padded_targets(self) -> None:
        """Name the decoder layers measured whole in batches whose labels were padded."""
        count = 0 if self._padded_targets is None else int(self._padded_targets)
        if count:
            message = (
                f"is in the decoder of an encoder-decoder model, but the batch has no {DECODER_MASK_KEY!r} while its "
                f"'labels' hold -100 (padded targets) in {count} batch(es): its padded target positions are measured "
                f"too. {_DECODER_MASK_ADVICE}"
            )
            for name in sorted(self._whole_decoder_layers):
                self._warn(name, "decoder mask", message)

    def _count_own(self, loader: int, size: int | None = None) -> int | None:
        """Leading rows of this batch (of ``size`` inputs, by default the batch's size) that are the process's own
        (``None``: all), counted off its loader's."""
        left = self._own_left[loader] if loader < len(self._own_left) else None
        size = self._batch if size is None else size
        if left is None or size is None:
            return None
        self._own_left[loader] = max(left - size, 0)
        return min(left, size)

    def _read_labels(self, batch: Any) -> Tensor | None:
        # An explicit label_key or label_fn that finds nothing raises here, at the first batch.
        labels = self.batch_reader.labels(batch, per_token=True)
        if labels is None:
            where = self.batch_reader.label_source(batch, per_token=True)
            message = f"num_classes={self.num_classes} but no class labels at {where}; the class metrics (TCV, "
            advice = f"class-wise VR) are not logged; {key_advice(batch, 'label')}." + several_loaders_advice(batch)
            # Read back from the device at a pass's first batch only: the warning is given once.
            refused = self.batch_reader.refused_label_advice(batch) if self.batches_seen == 0 else ""
            if refused:
                advice += f" The labels found are refused: {refused}."
            self._warn("", "labels", message + advice)
        return labels

    # -- a layer called more than once per batch (repeated_calls="each") -----------------------------------------

    def _application(self, name: str, k: int) -> str:
        """The name of the ``k``-th call (``k >= 2``) of layer ``name`` in a batch, ``<name>@<k>``: a layer of its own,
        which reads its outputs as the layer does (token layout, 1-d conv or channels-last maps)."""
        application = f"{name}@{k}"
        if application not in self._applications:
            self._applications[application] = (name, k)
            for known in (self.layouts, self.ambiguous_layouts, self.channel_maps, self.channels_last):
                if name in known:
                    known[application] = known[name]
        return application

    def _saved_application(self, name: str) -> bool:
        """Whether ``name``, a layer of a saved pass, is an application ``<layer>@<k>`` of a monitored layer (then
        known from now on)."""
        layer, _, k = name.rpartition("@")
        if self.repeated_calls != "each" or layer not in self.layers or not k.isdigit() or int(k) < 2:
            return False
        self._application(layer, int(k))
        return True

    def _all_layers(self) -> list[str]:
        """The monitored layers in depth order, each followed by its applications after the first."""
        after: dict[str, list[str]] = {}
        for application, (name, _) in sorted(self._applications.items(), key=lambda item: item[1][1]):
            after.setdefault(name, []).append(application)
        return [each for name in self.layers for each in (name, *after.get(name, ()))]

    def _logged_name(self, name: str) -> str:
        """The logged name of a measured layer: ``<layer>@1`` for the first call of a layer called more than once."""
        repeated = any(layer == name for layer, _ in self._applications.values())
        return f"{name}@1" if repeated else name

    def _check_calls(self) -> None:
        """Name a layer that the batch called another number of times than the pass's first batch (adaptive
        computation): its ``k``-th application sums the rows of the batches that made at least ``k`` calls."""
        if self._first_calls is None:
            self._first_calls = dict(self._calls_in_batch)
            return
        for name in self.layers:
            first, now = self._first_calls.get(name, 0), self._calls_in_batch.get(name, 0)
            if first != now and max(first, now) > 1:
                message = (
                    f"was called {first} time(s) in the pass's first batch and {now} in a later one (adaptive "
                    f"computation): its k-th application ({name}@k) sums the rows of the batches that called it at "
                    "least k times, so its applications stand on different rows (their spectrum_rows counts them)."
                )
                self._warn(name, "calls", message)

    def _agree_on_calls(self, device: torch.device | str) -> None:
        """Give every process the applications that any process ran (the collective that :meth:`compute` joins
        needs one list of layers on each); a layer whose applications ran on some processes only is named in a
        warning, and those applications are not logged (:meth:`_measured_everywhere`)."""
        n = len(self.layers)
        local = torch.tensor([self._most_calls.get(name, 0) for name in self.layers], dtype=torch.int64, device=device)
        lowest = highest = local
        if _distributed():
            both = torch.cat([local, -local])
            dist.all_reduce(both, op=dist.ReduceOp.MIN)
            lowest, highest = both[:n], -both[n:]
        for i, name in enumerate(self.layers):
            low, high = int(lowest[i]), int(highest[i])
            for k in range(2, high + 1):
                self._application(name, k)
            if low != high and high > 1:
                message = (
                    f"was called at most {low} time(s) per batch on some processes and {high} on others in a "
                    "monitored pass: the applications that ran on some processes only are not logged then."
                )
                self._warn(name, "calls across processes", message)

    @property
    def layers_run_in_batch(self) -> int:
        """The monitored layers that have run since the current batch started."""
        return len(self._seen_this_batch)

    def batch_end(self) -> None:
        """End a batch: give out the class Grams of the layers it called first (:meth:`_plan_class_grams`); after the
        pass's first batch, name every layer that did not run and report the planned memory."""
        if self._undecided:
            self._plan_class_grams()
        for name, calls in self._calls_in_batch.items():
            self._most_calls[name] = max(self._most_calls.get(name, 0), calls)
        if self.repeated_calls == "each":
            self._check_calls()
        self._take = 0
        self._in_batch = False
        self._batches_left -= 1
        self.batches_seen += 1
        if self.batches_seen != 1:
            return
        for name, path in self.layers.items() if self._name_uncalled else ():
            if name not in self._seen_this_batch:
                skipped = ", or output_selector returned None for its calls," if callable(self.output_selector) else ""
                message = (
                    f"({path}) was not called{skipped} in the forward pass of the pass's first monitored batch; it is "
                    "measured in the batches that call it only, and not logged if none does. Name a module that runs "
                    "(layers=[...])."
                )
                self._warn(name, "not called", message)
        if self._planned and self._planned != self._reported_plan:
            self._report_plan()
            self._reported_plan = dict(self._planned)

    def _report_plan(self) -> None:
        devices = sorted({str(metric.device) for metric in self.metrics.values()})
        total = mib_text(sum(self._planned.values()))
        budget = "" if self.memory_budget_mb is None else f" of a {self.memory_budget_mb:g} MiB budget"
        largest = max(self._planned, key=self._planned.__getitem__)
        detail = f" (largest {self._logged_name(largest)!r}: {mib_text(self._planned[largest])} MiB)"
        detail = detail if len(self._planned) > 1 else ""  # one layer: the total is its own
        plan = f"state of {count_of(len(self._planned), 'layer')}: {total} MiB{budget} on {', '.join(devices)}{detail}"
        self._info(plan + self._temporary_plan() + self._class_gram_plan())

    def _temporary_plan(self) -> str:
        """The largest float64 temporary of a layer's update in the batches so far (``update_chunk_mb`` bounds it),
        in words: it comes on top of the states, once at a time, at each layer's forward hook."""
        sizes = {name: metric.largest_update_bytes for name, metric in self.metrics.items()}
        if not sizes or not max(sizes.values()):
            return ""
        name = max(sizes, key=sizes.__getitem__)
        return f"; per-batch temporary up to {mib_text(sizes[name])} MiB ({self._logged_name(name)!r})"

    def _class_gram_plan(self) -> str:
        """Which planned layers have class Grams (the class-wise VR) and why the others have none, in words."""
        planned = [name for name in self._all_layers() if name in self._class_grams]
        if not planned:
            return ""
        have = [repr(self._logged_name(name)) for name in planned if self._class_grams[name] is None]
        without = [
            f"{self._logged_name(name)!r} ({self._class_grams[name]})"
            for name in planned
            if self._class_grams[name] is not None
        ]
        text = f"; class Grams (class-wise VR) of {', '.join(have) if have else 'no layer'}"
        return text + (f"; not of {'; '.join(without)}" if without else "")

    def _claim(self, size: int) -> int:
        """Rows of the current batch to measure; the first monitored layer to run decides for all of them.

        With ``max_samples`` the rows still to take are spread evenly over the batches left in the pass, so a
        loader sorted by class still gives rows of every class; when the pass's length is unknown (``inf``: an
        iterable dataset), the first ``max_samples`` rows are taken.
        """
        if self._take is None:
            if self._batch is None:  # a batch whose size only its outputs tell
                if self._offered_left is not None:
                    self._offered_left -= size
                self._own_rows = self._count_own(self._own_loader, size)
            if self._own_rows is not None:
                size = min(size, self._own_rows)
            if self.remaining is None:
                self._take = size
            else:
                left = self._batches_left
                share = self.remaining if math.isinf(left) else math.ceil(self.remaining / max(left, 1))
                self._take = max(0, min(size, self.remaining, share))
                self.remaining -= self._take
            self.inputs_measured += self._take
        return self._take

    # -- one layer's output ---------------------------------------------------------------------------------------

    def _hook(self, layer: FeatureLayer, output: Any) -> None:
        name = layer.name
        if not self._in_batch or in_backward():
            # A layer run by the backward pass is activation checkpointing recomputing the outputs of the batch's
            # forward pass (torch.utils.checkpoint): the same rows again, not another call of the layer.
            return
        try:
            activations = hidden_state(output, self.output_selector)
        except ValueError as error:
            raise ValueError(f"layer {name!r}: {error}") from error
        if activations is None and callable(self.output_selector):
            return  # the selector skips this call (another call of the layer in this batch may be the measured one)
        calls = self._calls_in_batch[name] = self._calls_in_batch.get(name, 0) + 1
        if calls > 1 and self.repeated_calls == "each":
            name = self._application(name, calls)  # the k-th call: a layer of its own
        elif calls > 1:
            # A module called twice per forward (a shared ReLU) would mix two representations.
            message = (
                "runs more than once per batch: a module called twice in one forward pass (a shared activation, a "
                "block applied N times as in ALBERT), or a step that makes several forward passes (generate(), a "
                "second view of the batch, one pass per training loader). Only its first call of each batch is "
                "measured; repeated_calls='each' measures each call as a layer of its own (<layer>@<k>). To measure "
                "another, monitor a module that runs once per forward pass, make the extra passes outside the step, "
                "or run the inputs of several training loaders or the views of the batch in one pass (torch.cat: "
                "rows that are a multiple of the batch's are measured as views of its inputs)."
            )
            self._warn(name, "reuse", message)
            return
        self._seen_this_batch.add(name)
        if self._not_batch_rows(name, activations):
            return
        if not isinstance(activations, Tensor) or not 2 <= activations.ndim <= _MAX_NDIM:
            shape = tuple(activations.shape) if isinstance(activations, Tensor) else type(output).__name__
            message = (
                "not (B, d) features, (B, T, D) tokens, (B, C, H, W) conv maps or (B, C, D1, D2, D3) 3-d conv maps; "
                "it is skipped."
            )
            self._warn(name, "shape", f"gives {shape}, {message} Set output_selector to pick its hidden state.")
            return
        if activations.ndim == 3 and name in self.channel_maps:
            channels = self.channel_maps[name]
            if channels is None or activations.shape[1] == channels or activations.shape[2] != channels:
                activations = activations.unsqueeze(-1)  # a 1-d conv map (B, C, L): C features at each of L positions
        if activations.ndim >= 4 and name in self.channels_last:
            token, widths = self.channels_last[name]
            if activations.shape[-1] in token and activations.shape[1] not in widths:
                # (B, H, W, C) -> (B, C, H, W); (B, D1, D2, D3, C) -> (B, C, D1, D2, D3)
                activations = activations.permute(0, activations.ndim - 1, *range(1, activations.ndim - 1))
                self._name_channels_last(name, tuple(activations.shape))
        activations = self._batch_first(name, activations.detach())
        if activations is None:
            return
        views = self._views(name, activations)
        if self._own_indices is not None:  # a combined batch of which some rows are repeats
            activations = activations[self._own_index_tensor(activations.device)]
        if name not in self._autocast:  # float32 outputs of a bf16 sublayer (a residual stream) carry its rounding
            self._autocast[name] = reduced_precision(activations, conv=name in self.channel_maps)
        take = self._claim(activations.shape[0] // views)
        metric = self._metric_for(name, activations)
        if metric is None or (not take and metric.update_count):
            return
        # A process whose rows are all taken (or repeats) still sizes its states at its first batch: it joins the
        # pass's collective with sums of the same shapes as the others (zeros), not as a layer it never ran.
        if views > 1:
            # The first ``take`` rows of every view, and each input's label once per view.
            activations = activations.unflatten(0, (views, -1))[:, :take].flatten(0, 1)
            labels = None if self._labels is None else self._view_labels(take, views, activations.device)
            if self._same_features(name, activations, metric):
                self._update(name, metric, activations, labels, None)
            return
        labels = None if self._labels is None else self._labels_of(name, activations, metric.reduction, take)
        mask = self._mask_of(name, activations)
        mask = None if mask is None else mask[:take].to(activations.device)
        if self._same_features(name, activations, metric):
            self._update(name, metric, activations[:take], labels, mask)

    def _not_batch_rows(self, name: str, activations: Any) -> bool:
        """Whether this output is done with before the batch's layout is read: an integer or boolean tensor (skipped,
        with a warning), the rows of a routed expert (skipped, with a warning) or, with ``unbatched``, any output
        (its ``(N, d)`` rows streamed as they come: :meth:`_unbatched_rows`)."""
        if isinstance(activations, Tensor) and not activations.is_floating_point():
            dtype = str(activations.dtype).removeprefix("torch.")
            message = (
                f"gives a {dtype} tensor of shape {tuple(activations.shape)}: indices or a mask (such as the experts "
                "a router chose), not a hidden state; it is skipped. Set output_selector to pick its hidden state "
                "(Switch Transformers' router returns (expert_index, router_probs, router_logits): output_selector=2 "
                "in a monitor of its own)."
            )
            self._warn(name, "dtype", message)
            return True
        if self.unbatched:
            self._unbatched_rows(name, activations)
            return True
        if self._applications.get(name, (name, 1))[0] in self._expert_layers:
            shape = tuple(activations.shape) if isinstance(activations, Tensor) else type(activations).__name__
            message = (
                f"gives {shape}: it is an expert of a mixture-of-experts layer, called on the tokens routed to it, "
                "whose rows belong to no input of the batch and whose number changes from batch to batch; it is "
                "skipped. Measure its rows as they come with unbatched=True in a monitor of its own (no class metrics)."
            )
            self._warn(name, "routed", message)
            return True
        return False

    def _unbatched_rows(self, name: str, activations: Any) -> None:
        """Stream every row of a ``(N, d)`` output whatever ``N`` (``unbatched``): no mask and no labels, its rows
        belonging to no input; a batch to which ``max_samples`` gives no input gives no rows."""
        if not isinstance(activations, Tensor) or activations.ndim != 2:
            shape = tuple(activations.shape) if isinstance(activations, Tensor) else type(activations).__name__
            message = "not the (N, d) rows that unbatched=True measures; it is skipped. Set output_selector to pick "
            message += "them (one 2-d tensor)."
            self._warn(name, "shape", f"gives {shape}, {message}")
            return
        activations = activations.detach()
        if name not in self._autocast:
            self._autocast[name] = reduced_precision(activations, conv=False)
        take = self._claim(activations.shape[0] if self._batch is None else self._batch)
        metric = self._metric_for(name, activations)
        if metric is None or (not take and metric.update_count):
            return
        if self._labels is not None:
            message = (
                "is measured with unbatched=True: its rows belong to no input of the batch, so no label is theirs and "
                "its class metrics (TCV, class-wise VR) are not logged."
            )
            self._warn(name, "unbatched labels", message)
        if self._same_features(name, activations, metric):
            self._update(name, metric, activations if take else activations[:0], None, None)

    def _views(self, name: str, activations: Tensor) -> int:
        """How many views of the batch's inputs a ``(B, d)`` or conv map output holds: ``k`` when its rows
        are ``k >= 2`` times the batch's (``torch.cat`` of ``k`` views run in one forward pass, view after view),
        said once per layer in a warning; else 1."""
        rows, batch = activations.shape[0], self._batch
        if activations.ndim == 3 or batch is None or rows == batch:
            return 1
        views = rows // batch
        message = (
            f"gives {tuple(activations.shape)} from a batch of {batch} inputs: read as {views} views of every input "
            f"run in one forward pass (torch.cat of the views, one after another): all {rows} rows are measured, "
            "max_samples counts inputs, and an input's label is that of each of its views."
        )
        self._warn(name, "views", message)
        return views

    def _view_labels(self, take: int, views: int, device: torch.device) -> Tensor | None:
        """The labels of the rows of ``views`` views of the batch's first ``take`` inputs, view after view."""
        labels = self._labels
        if not isinstance(labels, Tensor) or labels.ndim != 1 or labels.shape[0] < take:
            return self._grouping(take, device)  # the metric names labels of another shape
        return labels[:take].to(device).repeat(views)

    def _update(
        self,
        name: str,
        metric: ActivationSpectrum,
        activations: Tensor,
        labels: ClassGrouping | Tensor | None,
        mask: Tensor | None,
    ) -> None:
        """Stream a layer's rows of the batch; those of a layer whose class Grams are not decided yet wait for the end
        of the batch (:meth:`_plan_class_grams`), copied: the model may change its output in place later in the
        forward pass (an in-place ReLU)."""
        if name in self._undecided:
            self._held[name] = (activations.clone(), labels, mask)
        else:
            metric.update(activations, labels, mask=mask)

    def _name_channels_last(self, name: str, shape: tuple[int, ...]) -> None:
        """Say once per layer that its 4-D or 5-D output was read as channels-last: a layout told from shapes."""
        if name in self._channels_last_named:
            return
        self._channels_last_named.add(name)
        c = shape[1]
        given = (shape[0], *shape[2:], c)
        last, first = (
            ("(B, H, W, C)", "(B, C, H, W)") if len(shape) == 4 else ("(B, D1, D2, D3, C)", "(B, C, D1, D2, D3)")
        )
        message = (
            f"gives {given} outputs, read as channels-last {last} maps with C = {c}: their last "
            "dimension is the width of the layer's Linear / norm layers over the last dimension, their second that "
            f"of none of its layers (Swin's stages and blocks). Monitor a layer whose output is {first} if that "
            "is not so."
        )
        self._warn(name, "channels last", message)

    def _own_index_tensor(self, device: torch.device) -> Tensor:
        """The indices of the combined batch's own rows on ``device`` (moved once per batch for all layers)."""
        index = self._own_index_tensors.get(device)
        if index is None:
            index = self._own_index_tensors[device] = torch.tensor(self._own_indices, dtype=torch.long, device=device)
        return index

    def _same_features(self, name: str, activations: Tensor, metric: ActivationSpectrum) -> bool:
        """Whether the batch reduces to the layer's features; else a warning says why and the layer skips it."""
        first = self.layer_ndims.get(name, activations.ndim)
        if activations.ndim != first:
            # The layer's metric reduces outputs of its first kind: another kind would not reduce to its rows.
            message = (
                f"gives {tuple(activations.shape)}, a {activations.ndim}-d output where its first batch gave a "
                f"{first}-d one; such batches are skipped for this layer (its spectrum_rows counts the rest). Monitor "
                "a module whose outputs keep one shape."
            )
            self._warn(name, "dimensions", message)
            return False
        reduction = self.reductions.get(_kind(activations.ndim)) or "flatten"
        found, expected = _num_features(activations, reduction), metric.num_features
        if expected is None or found == expected:
            return True
        advice = {
            3: "tokens padded to each batch's longest sequence change the 'flatten' features: use "
            "token_reduction='token', 'mean' or 'last', or pad every batch to one length.",
            4: "inputs of several sizes change the 'flatten' features of conv maps: use conv_reduction='channel' or "
            "'mean', or one input size.",
        }.get(_kind(activations.ndim), "its width changed.")
        message = (
            f"gives {tuple(activations.shape)}, {found} features with reduction={reduction!r} where earlier batches "
            f"gave {expected}; such batches are skipped for this layer (its spectrum_rows counts the rest): "
        )
        self._warn(name, "features", message + advice)
        return False

    def _labels_of(self, name: str, activations: Tensor, reduction: str, take: int) -> ClassGrouping | Tensor | None:
        """The labels of this layer's rows: the batch's labels per input grouped by class; labels per token
        ``(B, T)`` grouped by class for a token layer under the ``"token"`` reduction whose tokens they label, and
        ``None`` with a warning for any other layer (its class metrics are not logged)."""
        labels = self._labels
        if not isinstance(labels, Tensor) or labels.ndim != 2 or labels.shape[0] != activations.shape[0]:
            return self._grouping(take, activations.device)
        tokens = activations.ndim == 3 and reduction == "token"
        if tokens and labels.shape[1] == activations.shape[1]:
            grouping = self._token_groupings.get(activations.device)
            if grouping is None:
                grouping = group_token_labels(labels[:take].to(activations.device), self.num_classes)
                self._token_groupings[activations.device] = grouping
            return grouping
        shape, given = tuple(activations.shape), tuple(labels.shape)
        if tokens:
            what = f"{shape[1]} tokens per input, but the batch's labels per token have shape {given}"
        else:
            rows = f"reduction={reduction!r}" if activations.ndim > 2 else "(B, d) features"
            what = f"one row per input ({rows}), but the batch's labels are per token, of shape {given}"
        message = (
            f"gives {shape}, {what}: its class metrics (TCV, class-wise VR) are not logged. Labels per token need "
            "token outputs (B, T, D) of as many positions and token_reduction='token'; a layer whose rows are inputs "
            "needs one label per input."
        )
        self._warn(name, "token labels", message)
        return None

    def _grouping(self, take: int, device: torch.device) -> ClassGrouping | Tensor:
        """The batch's labels (its first ``take``) grouped by class on ``device``: once per batch for all layers, so
        that a GPU synchronises once per batch, not once per layer."""
        grouping = self._groupings.get(device)
        if grouping is None:
            labels = self._labels[:take].to(device)
            if labels.ndim != 1 or labels.shape[0] != take:
                return labels  # the metric names the shape mismatch
            grouping = self._groupings[device] = group_by_class(labels, self.num_classes)
        return grouping

    def _mask_of(self, name: str, activations: Tensor) -> Tensor | None:
        """The mask of this token layer's positions when it fits its ``(B, T)``: the batch's attention mask, or in the
        decoder of an encoder-decoder the decoder's mask; ``None`` for a layer in an image tower, whose patches no mask
        of the batch belongs to; else ``None`` with a warning."""
        layer = self._applications.get(name, (name, 1))[0]  # every application reads the layer's mask
        if activations.ndim != 3 or layer in self._unmasked_layers:
            return None
        decoder = layer in self._decoder_layers
        mask = self._decoder_mask if decoder else self._mask
        cls = self.reductions.get(3) == "cls"
        if mask is None:
            if decoder and self._mask is not None and not cls:
                message = (
                    f"is in the decoder of an encoder-decoder model, but the batch has no {DECODER_MASK_KEY!r} (its "
                    f"{MASK_KEY!r} is the encoder's): its padded target positions are measured too. "
                    + _DECODER_MASK_ADVICE
                )
                self._warn(name, "decoder mask", message)
            elif decoder and not cls:
                self._whole_decoder_layers.add(name)  # named at the end of the pass if the labels were padded
            return None
        if cls:
            if self.batches_seen == 0:  # a pass's first batch: read now, so that the warning comes at once
                self._check_cls_position(name, mask, decoder)
            else:  # later batches: counted on the mask's device (reading it would synchronise a GPU), read at the end
                self._count_left_padding(name, mask, decoder)
            return None
        try:
            # Also fits a mask to tokens cut at the batch's longest sequence (nested tensors padded back).
            return check_token_mask(mask, activations)
        except ValueError as error:
            what = repr(DECODER_MASK_KEY) if decoder else "attention mask"
            self._warn(name, "mask", f"cannot use the batch's {what} ({error}); its padded positions are measured too.")
            return None

    def _check_cls_position(self, name: str, mask: Tensor, decoder: bool) -> None:
        """Warn when the first position of a sequence is padding (left padding): ``"cls"`` would measure its state."""
        left_padded = self._left_padded.get(decoder)
        if left_padded is None:  # read once for all layers of the mask
            left_padded = mask.ndim == 2 and bool(mask.shape[1]) and not bool(mask[:, 0].bool().all())
            self._left_padded[decoder] = left_padded
        if left_padded:
            self._warn(name, "cls padding", _CLS_LEFT_PADDING)

    def _count_left_padding(self, name: str, mask: Tensor, decoder: bool) -> None:
        """Count, on the mask's device, a batch after the pass's first whose mask pads some sequence on the left;
        :meth:`compute` warns for the ``"cls"`` layers of that mask."""
        self._cls_layers.setdefault(decoder, set()).add(name)
        if decoder in self._cls_counted or mask.ndim != 2 or not mask.shape[1]:
            return
        self._cls_counted.add(decoder)
        left = (~mask[:, 0].bool()).any().to(torch.int64)
        counted = self._left_padded_later.get(decoder)
        self._left_padded_later[decoder] = left if counted is None else counted + left.to(counted.device)

    def _warn_left_padding(self) -> None:
        """Name the ``"cls"`` layers whose masks padded on the left in a batch after the pass's first."""
        for decoder, count in self._left_padded_later.items():
            if int(count):
                for name in sorted(self._cls_layers.get(decoder, ())):
                    self._warn(name, "cls padding", _CLS_LEFT_PADDING)

    def _batch_first(self, name: str, activations: Tensor) -> Tensor | None:
        """``activations`` with the batch first; tokens may come sequence-first, ``(T, B, D)``."""
        batch, shape = self._batch, tuple(activations.shape)
        if activations.ndim != 3 or batch is None:
            if batch is None or shape[0] == batch:
                return activations
            # Views need a batch that tells its own size; with a mask, (B * T, D) rows may be tokens.
            unmasked = self._mask is None and self._decoder_mask is None and self._batch_told == "the batch"
            multiple = shape[0] > batch and shape[0] % batch == 0
            if multiple and len(shape) == 2 and shape[0] // batch in self._positions:
                self._warn(name, "flattened", _flattened_tokens(shape, batch))
                return None
            if multiple and self._own_indices is None and unmasked:
                return activations  # views of the batch run in one forward pass (_views)
            told = f" (told by {self._batch_told})" if self._batch_told != "the batch" else ""
            several = "" if shape[0] < batch else ", nor a multiple of it (views of the batch run in one pass)"
            if multiple:
                several = (
                    f"; its rows are {shape[0] // batch} times the batch's, which are read as views of the batch "
                    "only in a batch that tells its own size, has no attention mask and holds no repeated rows"
                )
            self._warn(
                name, "batch", f"gives {shape}, with no leading dimension of the batch size {batch}{told}{several}."
            )
            return None
        layout = self.layouts.get(name)
        if layout is None and (shape[0] == batch) != (shape[1] == batch):
            layout = self.layouts[name] = shape[0] == batch  # unambiguous: remembered for later batches
        if layout is None and shape[0] == batch:  # as many tokens as sequences: read as the model's kind says
            layout = self.ambiguous_layouts.get(name)
        if layout is None:
            reason = "in both leading dimensions" if shape[0] == batch else "in neither leading dimension"
            message = f"gives {shape} with the batch size {batch} {reason}: its token layout cannot be told. "
            self._warn(name, "layout", message + "Set token_layout='batch_first' or 'sequence_first'.")
            return None
        if shape[0 if layout else 1] != batch:
            self._warn(name, "batch", f"gives {shape}, not {'(B, T, D)' if layout else '(T, B, D)'}, B={batch}.")
            return None
        return activations if layout else activations.transpose(0, 1)

    def _metric_for(self, name: str, activations: Tensor) -> ActivationSpectrum | None:
        metric = self.metrics.get(name)
        if metric is not None or name in self._planned:
            return metric
        reduction = self.reductions.get(_kind(activations.ndim))
        self.layer_ndims[name] = activations.ndim
        options = dict(self.spectrum_options, reduction=reduction or "flatten")
        with activations.device:  # the states are made where they live: no copies (on a GPU, each one waits)
            metric = self._within_budget(name, _num_features(activations, options["reduction"]), options)
        if metric is not None:
            self.metrics[name] = metric.to(activations.device)
        return metric

    def _within_budget(self, name: str, num_features: int, options: dict[str, Any]) -> ActivationSpectrum | None:
        """The layer's metric, sized to what is left of the memory budget (its fallback when the Gram is too big).

        An exact Gram is taken when it fits in what is left. A fallback fills the budget it is given, so it gets an
        even share of what is left among the layers not planned yet (or what it needs, if more): a larger budget then
        never leaves a later layer fewer rows, or none, where a smaller one would not.
        """
        if self.memory_budget_bytes is None:
            metric = ActivationSpectrum(num_classes=self.num_classes, **options)
            self._planned[name] = metric.planned_bytes(num_features)
            return metric
        left = self.memory_budget_bytes - sum(self._planned.values())
        own = min(options.get("memory_budget_mb", math.inf) * _MIB, left)
        metric, planned = self._sized(num_features, options, own)
        unplanned = sum(1 for layer in self._all_layers() if layer not in self._planned)
        if metric.path_for(num_features) != "gram" and unplanned > 1:
            metric, planned = self._sized(num_features, options, min(own, left / unplanned))
        if planned > left:
            used = sum(self._planned.values())
            needs = f"layer {name!r} ({num_features} features) needs {mib_text(planned)} MiB of state even on its "
            needs += "fallback path"
            advice = "Monitor fewer layers, raise memory_budget_mb, or lower max_gram_features."
            sums = (self.num_classes or 0) * num_features * _FLOAT64_BYTES
            if 2 * sums > planned:
                # Mostly the class sums (a vocabulary's worth of classes), which no path makes smaller.
                classes = count_of(self.num_classes, "class", "classes")
                needs += f" ({mib_text(sums)} MiB of it the sums of its {classes}, on every path)"
                advice = "Raise memory_budget_mb, monitor fewer layers, or pass fewer classes (num_classes)."
            if used:
                where = f", but the other monitored layers already plan {mib_text(used)} MiB of the "
            else:
                where = ", more than all of the "
            raise MemoryError(f"{needs}{where}memory_budget_mb={self.memory_budget_mb:g}. {advice}")
        metric, planned = self._spectrum_first(name, num_features, options, metric, planned, left)
        self._planned[name] = planned
        return metric

    def _spectrum_first(
        self, name: str, d: int, options: dict[str, Any], metric: ActivationSpectrum, planned: int, left: int
    ) -> tuple[ActivationSpectrum, int]:
        """The layer's plan without class Grams, which are not given out yet: ``metric`` (``planned`` bytes of the
        ``left``) when it has none; else its exact Gram alone, its class Grams waiting for the end of the batch
        (:meth:`_plan_class_grams`), when the spectra of the layers it calls later are planned."""
        if not (self.num_classes and options.get("classwise", True)):
            return metric, planned
        path = metric.path_for(d)
        if path != "gram":
            gives = "which gives no class-wise VR" if path == "sketch" else "whose subsample gives its class-wise VR"
            self._class_grams[name] = f"its spectrum takes the {path!r} path, {gives}"
            return metric, planned
        gram = d * d * _FLOAT64_BYTES  # a budget of the Gram alone: the exact path, no class Grams
        exact = ActivationSpectrum(num_classes=self.num_classes, **dict(options, memory_budget_mb=gram / _MIB))
        exact_bytes = exact.planned_bytes(d)
        if planned > exact_bytes:  # its class Grams fit in what is left now
            self._undecided[name] = (d, metric, planned)
        else:
            self._class_grams[name] = (
                f"{_class_grams(self.num_classes, d)} are more than the {mib_text(left - exact_bytes)} MiB that its "
                "spectrum and those of the layers planned before it leave"
            )
        return exact, exact_bytes

    def _plan_class_grams(self) -> None:
        """Give the layers whose class Grams wait (their spectra planned) what the spectra leave of the budget, then
        stream the rows they held.

        The layers whose class Grams are smallest come first, each within an even share of what is left among the
        layers still waiting; from the first whose class Grams exceed it, no layer has any (those of the others are
        larger): a layer has class Grams only if every layer whose class Grams are smaller has them, and layers of one
        width all have them or none does.
        """
        left = self.memory_budget_bytes - sum(self._planned.values())
        order = self._all_layers()
        extras = {name: planned - self._planned[name] for name, (_, _, planned) in self._undecided.items()}
        waiting = sorted(extras, key=lambda name: (extras[name], order.index(name)))
        first_refused = None
        for place, name in enumerate(waiting):
            d, metric, planned = self._undecided.pop(name)
            share = left / (len(waiting) - place)
            if first_refused is None and extras[name] <= share:
                self.metrics[name] = metric.to(self.metrics[name].device)
                self._planned[name], self._class_grams[name] = planned, None
                left -= extras[name]
                continue
            if first_refused is None:
                first_refused = name
                why = f"more than an even share, {mib_text(share)} MiB, of the {mib_text(left)} MiB that the spectra "
                why += "leave"
            else:
                why = f"no smaller than those of {first_refused!r}, which exceed their even share"
            self._class_grams[name] = f"{_class_grams(self.num_classes, d)} are {why}"
        held, self._held = self._held, {}
        for name, (rows, labels, mask) in held.items():
            self.metrics[name].update(rows, labels, mask=mask)

    def _sized(self, num_features: int, options: dict[str, Any], limit: float) -> tuple[ActivationSpectrum, int]:
        """A metric whose states plan at most ``limit`` bytes where it can, and the bytes it plans."""
        own = limit
        for _ in range(8):
            # The metric sizes its Gram or fallback to its budget; its small states (sums, counts, the subsample's
            # keys and labels) come on top, so the budget shrinks by what they overshoot, and by a row more.
            budget = dict(options, memory_budget_mb=max(own, 1) / _MIB)
            metric = ActivationSpectrum(num_classes=self.num_classes, **budget)
            planned = metric.planned_bytes(num_features)
            if planned <= limit or own <= 1:
                break
            own -= planned - limit + _FLOAT64_BYTES * (num_features + 2)
        return metric, planned

    # -- the pass's values ----------------------------------------------------------------------------------------

    def used_reductions(self) -> dict[str, str]:
        """``{"conv maps": reduction, "tokens": reduction}`` for the kinds of output the measured layers gave."""
        kinds = sorted({_kind(n) for n in self.layer_ndims.values()}, reverse=True)
        return {_KINDS[n]: self.reductions[n] for n in kinds if n in _KINDS}

    def compute(
        self, device: torch.device | str, *, metrics: tuple[str, ...], centered: bool, per_class: bool, when: str = ""
    ) -> tuple[dict[str, dict[str, float]], int]:
        """Unhook, compute every layer measured on every process, and reset the sums.

        A collective under DDP: every process must call it. Returns ``({layer: {key: value}}, inputs measured over
        all processes)``; the keys of conv and token layers carry their reduction (``"channel/numerical_rank"``).
        ``when`` names the pass in warnings (``"at epoch 3"``).
        """
        inputs = torch.tensor(self.inputs_measured, device=device)
        self._max_samples_reached = self.max_samples is not None and self.remaining == 0
        autocast = dict(self._autocast)
        wrong_masks = 0 if self._wrong_masks is None else int(self._wrong_masks)
        if wrong_masks:
            message = (
                f"the attention masks of {wrong_masks} batch(es) {when} held values other than 0 and 1 (read as real "
                "tokens where not 0); the token layers may count padding. Pass a boolean or 0 / 1 mask (mask_key)."
            )
            self._warn("", "mask values", message)
        self._warn_left_padding()
        self._warn_padded_targets()
        self.stop()
        self._clear_notes()
        if _distributed():
            dist.all_reduce(inputs)
        if self.repeated_calls == "each":
            self._agree_on_calls(device)
        values = {}
        for name in self._measured_everywhere(device):
            values[self._logged_name(name)] = self._values_of(
                name, metrics=metrics, centered=centered, per_class=per_class, when=when
            )
            self._check_tolerance(self.metrics[name], metrics, autocast.get(name))
        for metric in self.metrics.values():
            metric.reset()
        return values, int(inputs)

    def _measured_everywhere(self, device: torch.device | str) -> list[str]:
        """The layers that every process measured in this pass: ``compute()`` is a collective all of them join."""
        layers = self._all_layers()
        n = len(layers)
        counts = [self.metrics[name].update_count if name in self.metrics else 0 for name in layers]
        widths = [(self.metrics[name].num_features or 0) if name in self.metrics else 0 for name in layers]
        grams = [int(name in self.metrics and self.metrics[name].uses_class_grams) for name in layers]
        local = torch.tensor(counts + widths + grams, dtype=torch.int64, device=device)
        lowest = highest = local
        if _distributed():
            # One all-reduce gives both the minimum and (negated) the maximum over processes.
            both = torch.cat([local, -local])
            dist.all_reduce(both, op=dist.ReduceOp.MIN)
            lowest, highest = both[: 3 * n], -both[3 * n :]
        for i, name in enumerate(layers):
            if int(lowest[i]) > 0 and int(lowest[2 * n + i]) != int(highest[2 * n + i]):
                self._drop_class_grams(name)
        measured = []
        for i, name in enumerate(layers):
            low, high = int(lowest[i]), int(highest[i])
            narrow, wide = int(lowest[n + i]), int(highest[n + i])
            if low > 0 and narrow != wide:
                # Each process's first batch fixed the layer's features (a 'flatten' of per-batch lengths or sizes):
                # sums of other shapes cannot be added.
                message = (
                    f"reduces to {narrow} features on some processes and {wide} on others (each fixed by its first "
                    "batch: a 'flatten' of inputs whose length or size varies); it is not logged in this run. Use the "
                    "'token' / 'mean' or 'channel' / 'mean' reductions, or inputs of one size."
                )
                self._warn(name, "widths", message)
            elif low > 0:
                measured.append(name)
            elif high > 0:
                self._warn(name, "unmeasured", "ran on some processes only in a monitored pass; it is not logged then.")
        return measured

    def _drop_class_grams(self, name: str) -> None:
        """Add the layer's class Grams into its Gram and plan it without them, as the processes where they did not fit
        (another process's layers, run on some processes only, took the memory): the sums of every process then add
        up; its spectrum and TCV are kept, its class-wise VR is not computed."""
        metric = self.metrics[name]
        if metric.uses_class_grams:
            d = int(metric.num_features)
            metric.gram = metric.gram + metric.class_grams.sum(dim=0)
            metric.class_grams = metric.class_grams.new_zeros(0)
            metric.memory_budget_bytes = d * d * _FLOAT64_BYTES  # the Gram alone: the exact path, no class Grams
            self._planned[name] = metric.planned_bytes(d)
        self._class_grams[name] = (
            "they fitted on some processes only (the layers that run on some processes only take memory there), and "
            "the sums of every process must have one shape"
        )

    def _values_of(
        self, name: str, *, metrics: tuple[str, ...], centered: bool, per_class: bool, when: str
    ) -> dict[str, float]:
        metric = self.metrics[name]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # Replaced below by a warning that names the layer.
            warnings.filterwarnings("ignore", message="ActivationSpectrum: .*NaN or Inf", category=RuntimeWarning)
            result = metric.compute()
        for caught_warning in caught:
            why = self._class_grams.get(name)
            if why and str(caught_warning.message).startswith(_NO_CLASS_GRAMS):
                # The metric was given its spectrum's share of the budget: the plan says why it has no class Grams.
                message = f"has no class Grams, so its class-wise variance ratio is not computed: {why}. {_MORE_MEMORY}"
                self._warn(name, "class grams", message)
                continue
            # The metric's own warnings (rounding limits, unlabelled rows) say which layer they are about.
            message = str(caught_warning.message).replace("ActivationSpectrum: ", f"layer {name!r}: ", 1)
            warnings.warn(message, caught_warning.category, stacklevel=3)
        if result.num_nonfinite_batches:
            warnings.warn(
                f"layer {name!r} gave NaN or Inf activations in {result.num_nonfinite_batches} batch(es) {when}; its "
                "metrics are logged as NaN for that pass.",
                RuntimeWarning,
                stacklevel=3,
            )
        self._check_classes(name, result.class_counts, result.num_samples)
        self._check_cap(name, metric, result)
        self._check_zero(name, result, when)
        reduction = self.reductions.get(_kind(self.layer_ndims.get(name, 2)))
        prefix = f"{reduction}/" if reduction and self.layer_ndims.get(name, 2) > 2 else ""
        scalars = result.scalars(metrics, centered=centered, per_class=per_class)
        return {f"{prefix}{key}": value for key, value in scalars.items()}

    def _check_tolerance(
        self, metric: ActivationSpectrum, metrics: tuple[str, ...], reduced: tuple[torch.dtype, str] | None
    ) -> None:
        """Warn when activations computed in half precision (outputs in bf16 / fp16, or float32 outputs of layers run
        under autocast or with TF32 / bf16 products: :func:`reduced_precision`) get the float32 tolerance, under which
        their rounding noise counts as rank."""
        chosen = metric.tolerance_dtype
        if "numerical_rank" not in metrics or metric.rank_tolerance is not None or chosen not in (None, "input"):
            return
        eps = float(metric.input_eps)
        if eps > torch.finfo(torch.float32).eps:
            if chosen == "input":
                return  # their own dtype's tolerance
            dtype = "bfloat16" if eps == torch.finfo(torch.bfloat16).eps else "float16"
            where, advice = f"were computed in {dtype}", "tolerance_dtype='input'"
        elif reduced is not None:
            dtype, where = str(reduced[0]).removeprefix("torch."), reduced[1]
            advice = f"tolerance_dtype=torch.{dtype}"
        else:
            return
        if chosen == "input":
            where += ", so tolerance_dtype='input' found float32 outputs"
        message = (
            f"the monitored activations {where}, but numerical_rank takes the float32 tolerance, under which their "
            f"rounding noise counts as rank. Set {advice} for the tolerance of {dtype} (tolerance_dtype=torch.float32 "
            "keeps the float32 rule without this warning)."
        )
        self._warn("", "tolerance", message)

    def _check_zero(self, name: str, result: Any, when: str) -> None:
        """Warn when the measured activations are all zero (a dead layer) or, centred, all equal: every rank is 0 and
        the ratios of sums of squares (variance ratios, normalised TCV) are 0 / 0, logged as NaN."""
        if result.num_nonfinite_batches:
            return
        kinds = (
            (result.uncentered, "only zeros", "a dead layer, e.g. a ReLU whose inputs are all negative"),
            (result.centered, "the same output for every input", "a constant layer; centred, it is zero"),
        )
        for summary, what, why in kinds:
            if summary is not None and float(summary.spectral_norm) == 0:
                message = (
                    f"gave {what} {when} ({why}): its ranks are 0 and its variance ratios and normalised TCV, "
                    "0 / 0, are logged as NaN."
                )
                self._warn(name, "zero", " ".join(message.split()))
                return

    def _check_classes(self, name: str, counts: Tensor | None, rows: int) -> None:
        if counts is None or not counts.numel() or not int(counts.sum()):
            return
        missing = [c for c, count in enumerate(counts.tolist()) if count == 0]
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
            message = f"saw no rows of classes [{shown}] among the {rows} measured"
            if len(missing) > 10:
                message += f" ({len(missing)} of its {counts.numel()} classes)"
            advice = "raise max_samples or shuffle the loader"
            if len(missing) > 10:  # a vocabulary of next-token classes: most tokens are absent from a window's text
                advice += "; with the tokens of a vocabulary as classes, most are expected to be absent"
            self._warn(name, "classes", message + f"; TCV and class-wise VR cover the others only ({advice}).")

    def _check_cap(self, name: str, metric: ActivationSpectrum, result: Any) -> None:
        """Warn when the ranks cannot exceed the rows behind the spectrum (fallback path, or fewer rows than d)."""
        cap, d = getattr(result, "rank_cap", None), result.num_features
        if result.path != "gram":
            if d > metric.max_gram_features:
                message = f"has {d} features, more than max_gram_features={metric.max_gram_features}; its spectrum "
            else:
                message = f"has {d} features, whose {d} x {d} Gram does not fit in its share of memory_budget_mb; its "
                message += "spectrum "
            rows = getattr(result, "spectrum_rows", result.num_spectrum_samples)
            capped = f"comes from the {result.path!r} path ({rows} rows), so its ranks are at most {cap}."
            self._warn(name, "path", message + capped)
        elif cap is not None and d is not None and cap < d:
            message = f"was measured on {count_of(result.num_samples, 'row')}, fewer than its {d} features: its ranks "
            message += "are at "
            more = "raise max_samples" if self._max_samples_reached else "measure more batches"
            self._warn(name, "rows", message + f"most {cap} ({more} to measure more rows).")


def _on_cpu(value: Any) -> Any:
    """A metric state (a tensor, or a list of them) as a copy on the CPU."""
    if isinstance(value, Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, list):
        return [_on_cpu(part) for part in value]
    return value


def _class_grams(num_classes: int, d: int) -> str:
    """The class Grams of a layer of ``d`` features and their size, in words."""
    size = mib_text(num_classes * d * d * _FLOAT64_BYTES)
    return f"its {count_of(num_classes, 'class Gram')} of {d} x {d}, {size} MiB,"


def _collection(loader: Any) -> bool:
    """Whether ``loader`` is a collection of loaders (a list, tuple or mapping), whose batches are combined."""
    return isinstance(loader, (Mapping, list, tuple))


def _rows_of(values: Tensor | None, keep: Tensor, rows: int) -> Tensor | None:
    """The rows ``keep`` of a batch's labels or mask of ``rows`` rows; anything else unchanged (the reader names
    it)."""
    if not isinstance(values, Tensor) or values.ndim == 0 or values.shape[0] != rows:
        return values
    return values[keep.to(values.device)]


def _num_features(activations: Tensor, reduction: str) -> int:
    """Columns of the reduced ``(N, d)`` matrix of an output (see :func:`~rank_lightning.functional.reductions`)."""
    if activations.ndim == 2:
        return activations.shape[1]
    if activations.ndim == 3:
        return activations.shape[1] * activations.shape[2] if reduction == "flatten" else activations.shape[2]
    if reduction == "flatten":
        return math.prod(activations.shape[1:])
    return activations.shape[1]


_DECODER_MASK_ADVICE = (
    f"Put the target's mask in the batch as {DECODER_MASK_KEY!r} (true / 1 at the real target tokens, e.g. labels != "
    "-100 for right-padded labels), or measure the decoder apart with a mask_key naming its mask."
)
_CLS_LEFT_PADDING = (
    "uses token_reduction='cls', but the attention mask marks the first position of some sequences as padding (left "
    "padding), whose hidden state is measured there. Pad on the right, or use token_reduction='last' (each "
    "sequence's last real token, the sequence embedding of a decoder-only model), token_reduction='token' or 'mean'."
)


def reduced_precision(activations: Tensor, *, conv: bool) -> tuple[torch.dtype, str] | None:
    """The half precision whose rounding float32 ``activations`` carry, and how, in words; ``None`` if none: layers
    run under bf16 / fp16 autocast (float32 outputs that add half-precision results, a residual stream), or float32
    products that torch's flags let run in TF32 (the tolerance of float16, whose 10-bit mantissa TF32 has) or bf16
    (:func:`reduced_float32_format`; ``conv``: the layer is a convolution)."""
    device = activations.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in (torch.bfloat16, torch.float16):
        dtype = torch.get_autocast_dtype(device)
        name = str(dtype).removeprefix("torch.")
        return dtype, f"ran under {name} autocast (float32 outputs that add {name} results, a residual stream)"
    if activations.dtype != torch.float32:
        return None
    conv = conv or activations.ndim >= 4
    reduced = reduced_float32_format(device, conv=conv)
    if reduced is None:
        return None
    flag = ("cudnn.conv" if conv else "cuda.matmul") if device == "cuda" else f"mkldnn.{'conv' if conv else 'matmul'}"
    how = (
        f"were computed with {reduced.upper()} products in float32 (torch.backends.{flag}.fp32_precision, or "
        "torch.set_float32_matmul_precision)"
    )
    return (torch.float16 if reduced == "tf32" else torch.bfloat16), how


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass in this thread, where ``torch.utils.checkpoint`` (and
    the activation checkpointing built on it: ``transformers``, FSDP's ``checkpoint_wrapper``) recomputes the forward
    pass of its checkpointed modules, hooks included. The test that ``torch.utils.module_tracker.ModuleTracker`` makes
    to tell the backward pass from the forward pass."""
    return torch._C._current_graph_task_id() != -1


def _default_warn(layer: str, kind: str, message: str) -> None:
    warnings.warn(f"layer {layer!r} {message}" if layer else message, UserWarning, stacklevel=3)
