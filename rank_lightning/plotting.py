"""Every figure the package draws, from plain numbers: the callbacks and ``analysis.report`` share these functions.

Figures are drawn synchronously with matplotlib's object-oriented API (``Figure``, no pyplot state), so drawing
never touches a global figure manager and can run inside any training loop. Each function returns the ``Figure``;
:func:`save_figure` writes it.

Figures are meant to be shown as they are, in a paper or a talk: titles say in words what is drawn
(:func:`figure_title`: "Numerical rank of the activations (channels: every spatial position a sample)" for the key
``channel/numerical_rank`` of the namespace ``rank``), axes carry units (:func:`axis_label`), lines stay dark enough
to read on white (contrast of at least 3:1) and tell 20 and more layers apart by colour, marker and line style
(:func:`line_styles`), and a caption line states how the values were measured (:func:`caption_text`: split, number of
samples, reduction, rank tolerance). Epoch ``-1`` (:data:`INITIAL_EPOCH`, the model before its first training step) is
drawn at the left end of epoch axes and labelled ``init``.

Layout uses fixed margins computed from the length of the texts rather than a layout engine, which measures every text
twice and doubles the drawing time.

Drawing time is mostly text: with matplotlib 3.11 a glyph takes 0.1-0.2 ms to lay out and rasterise, and the 45 texts
(about 600 glyphs) of a :func:`layer_curves_figure` took three quarters of its drawing time. Figures keep every text
and avoid the work around them instead: panel titles are placed (``_TITLE_Y``), value axes carry fewer ticks
(``_VALUE_BINS``) and :func:`save_figure` draws and writes PNG files itself. On two shared cores, medians of 15
figures in three runs, a figure of 4 layers and 31 epochs (built and saved) went from 0.30-0.36 s to 0.20-0.22 s and
one of 30 layers from 0.39-0.46 s to 0.29-0.36 s; counted by callgrind, from 1.14 to 0.58 and from 1.49 to 0.86
billion instructions. The rest is matplotlib's own work per artist and per glyph: of a figure of 4 layers, building
takes 25-40 ms, drawing 110-180 ms (three quarters of it text) and writing the file 11-15 ms.
"""

from __future__ import annotations

import math
import re
import struct
import textwrap
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib import colormaps, rc_context
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator

from rank_lightning.files import replace_file

__all__ = [
    "INITIAL_EPOCH",
    "Reference",
    "adversarial_figure",
    "axis_label",
    "caption_text",
    "classification_dimension_figure",
    "contrast_on_white",
    "epoch_label",
    "evenly_spaced",
    "figure_filename",
    "figure_title",
    "layer_curves_figure",
    "line_styles",
    "runs_vs_depth_figure",
    "runs_vs_epoch_figure",
    "save_figure",
    "sqrt_width_reference",
    "theorem5_reference",
]

INITIAL_EPOCH = -1
"""The epoch under which a value measured before the first training step is recorded (shown as ``init``)."""

_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9_.=-]+")

# Curves: epoch -> layer -> metric -> value.
History = Mapping[int, Mapping[str, Mapping[str, float]]]


def figure_filename(*parts: str) -> str:
    """``"<part>_<part>"`` with every character other than letters, digits and ``_.=-`` replaced by ``_``."""
    return _UNSAFE_FILENAME.sub("_", "_".join(parts))


def save_figure(figure: Figure, path: str | Path, dpi: int = 100) -> Path:
    """Write ``figure`` to ``path`` (its folder is created) and return the path.

    PNG files are drawn and written here rather than by ``Figure.savefig``, with the pixels ``savefig`` draws under
    the same settings. Measured with matplotlib 3.11 on two cores for a :func:`layer_curves_figure` of 4 layers and
    31 epochs (instructions counted by callgrind, 0.58 billion per figure with all three):

    - Agg keeps its caches of text extents and of parsed mathtext per renderer, and ``savefig`` makes a new renderer
      for every figure. Figures of the same size in pixels drawn on one thread share a renderer here (a thread keeps
      its two last), so the tick labels, legend entries, titles and caption that the figures of a run have in common
      are measured once: a tenth fewer instructions per figure.
    - Text is rasterised without font hinting (``text.hinting`` is ``"no_hinting"`` while drawing): FreeType lays
      out and renders a glyph in 50-60% of the time the font's bytecode hinting takes, a fifth fewer instructions
      per figure, and 9-13 point text looks the same at 100 dpi.
    - The pixels go into the file as one unfiltered zlib stream at level 1: Pillow's choice of a filter for every
      row made writing take 28-50 ms instead of 12-24 ms, for files 5-11% larger.

    Other formats go through ``Figure.savefig``; the ``savefig.*`` settings of matplotlib do not apply to PNG files.
    Either way the file is replaced in one step (:func:`~rank_lightning.files.replace_file`): a failed or interrupted
    write leaves the earlier file whole.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        return replace_file(path, lambda file: figure.savefig(file, dpi=dpi, format=path.suffix[1:] or None))
    old_canvas, old_dpi = figure.canvas, figure.dpi
    canvas = _SharedRendererCanvas(figure)
    try:
        figure.dpi = dpi
        with rc_context(_DRAWING_RC):
            canvas.draw()
        _write_png(path, np.asarray(canvas.buffer_rgba()), dpi)
    finally:
        figure.dpi = old_dpi
        figure.set_canvas(old_canvas)
    return path


# matplotlib settings while save_figure draws (rc_context applies them to every thread: a figure drawn by another
# thread meanwhile is drawn with them too).
_DRAWING_RC = {"text.hinting": "no_hinting"}
_RENDERERS_PER_THREAD = 2  # a run's figures of two sizes (two namespaces) without making renderers again
_THREAD = threading.local()


_WHOLE_PIXEL_RENDERERS = tuple(int(part) for part in matplotlib.__version__.split(".")[:2]) >= (3, 11)


class _SharedRendererCanvas(FigureCanvasAgg):
    """An Agg canvas that draws on its thread's renderer of the same size and resolution, kept from the figures
    drawn before (see :func:`save_figure`); a thread keeps its ``_RENDERERS_PER_THREAD`` most recently used ones."""

    def get_renderer(self) -> RendererAgg:
        """The thread's renderer of this figure's size in pixels and resolution, made when it has none."""
        # The size FigureCanvasAgg.get_renderer gives its renderer, so the pixels are savefig's: whole pixels
        # (rounded) from matplotlib 3.11, the figure's size as it is (544.99... pixels for 5.45 inches at 100 dpi)
        # before, which places every artist a fraction of a pixel from where whole pixels would.
        width, height = self.get_width_height(physical=True) if _WHOLE_PIXEL_RENDERERS else self.figure.bbox.size
        key = (width, height, self.figure.dpi)
        renderers: dict[tuple[float, float, float], RendererAgg] = _THREAD.__dict__.setdefault("renderers", {})
        renderer = renderers.pop(key, None)
        if renderer is None:
            renderer = RendererAgg(width, height, self.figure.dpi)
        renderers[key] = renderer  # most recently used last
        while len(renderers) > _RENDERERS_PER_THREAD:
            del renderers[next(iter(renderers))]
        self.renderer = renderer
        return renderer


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _write_png(path: Path, rgba: np.ndarray, dpi: float) -> None:
    """Write an ``(height, width, 4)`` array of 8-bit RGBA pixels as a PNG file, rows unfiltered."""
    height, width = rgba.shape[:2]
    rows = np.empty((height, 1 + 4 * width), np.uint8)
    rows[:, 0] = 0  # filter type: none
    rows[:, 1:] = rgba.reshape(height, 4 * width)
    pixels_per_metre = round(dpi / 0.0254)
    software = f"Software\0matplotlib {matplotlib.__version__}".encode("latin-1")
    chunks = [
        b"\x89PNG\r\n\x1a\n",
        _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)),
        _png_chunk(b"pHYs", struct.pack(">IIB", pixels_per_metre, pixels_per_metre, 1)),
        _png_chunk(b"tEXt", software),
        _png_chunk(b"IDAT", zlib.compress(rows, 1)),
        _png_chunk(b"IEND", b""),
    ]
    replace_file(path, lambda file: file.writelines(chunks))


def evenly_spaced(items: Sequence[int], count: int) -> list[int]:
    """At most ``count`` of ``items``, evenly spaced, first and last included."""
    if len(items) <= count:
        return list(items)
    picks = {round(i * (len(items) - 1) / (count - 1)) for i in range(count)}
    return [items[i] for i in sorted(picks)]


def epoch_label(epoch: int) -> str:
    """``"init"`` for :data:`INITIAL_EPOCH`, else ``"epoch <n>"``."""
    return "init" if epoch == INITIAL_EPOCH else f"epoch {epoch}"


# -- words for keys --------------------------------------------------------------------------------------------------

_DIMENSIONS = "(dimensions)"
# Metric family -> (title, axis label with its unit).
_FAMILIES: dict[str, tuple[str, str]] = {
    "numerical_rank": ("Numerical rank", f"numerical rank {_DIMENSIONS}"),
    "soft_rank": ("Soft rank", f"soft rank {_DIMENSIONS}"),
    "participation_ratio": ("Participation ratio r(H)", f"r(H) {_DIMENSIONS}"),
    "stable_rank": ("Stable rank", f"stable rank {_DIMENSIONS}"),
    "effective_rank": ("Effective rank", f"effective rank {_DIMENSIONS}"),
    "spectral_norm": ("Spectral norm", "largest singular value $s_1$"),
    "tcv": ("Total cluster variation (TCV)", "TCV (squared distance to the class means)"),
    "tcv_normalized": ("Normalised total cluster variation", "TCV / total sum of squares (fraction)"),
    "rank": ("Partial Jacobian rank", f"rank {_DIMENSIONS}"),
    "rank_max": ("Largest possible partial Jacobian rank", f"rank {_DIMENSIONS}"),
}
_VR = "VR$_{{{0}}}$"
# Families with a parameter in their key: pattern -> (title, axis label), formatted with the pattern's groups.
_PARAMETRIC: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"variance_ratio_(\d+)"), f"Variance ratio {_VR}", f"{_VR} (fraction of the variance)"),
    (
        re.compile(r"classwise_variance_ratio_(\d+)_mean"),
        f"Class-wise variance ratio {_VR}, mean over classes",
        f"class-wise {_VR} (fraction of the class variance)",
    ),
    (
        re.compile(r"classwise_variance_ratio_(\d+)_class_(\d+)"),
        f"Class-wise variance ratio {_VR} of class {{1}}",
        f"class-wise {_VR} (fraction of the class variance)",
    ),
    (
        re.compile(r"tail_error_k(\d+)"),
        "Tail error beyond rank {0}",
        "relative Frobenius error of the best rank-{0} approximation",
    ),
    (re.compile(r"rank_input_(\d+)"), "Partial Jacobian rank at input {0}", f"rank {_DIMENSIONS}"),
)
_REDUCTIONS: dict[str, str] = {
    "flatten": "flattened: one vector per sample",
    "channel": "channels: every spatial position a sample",
    "token": "tokens: every token a sample",
    "cls": "first (CLS) token",
    "mean": "mean over positions or tokens",
    "last": "last real token",
}
_NAMESPACES: dict[str, str] = {
    "rank": "of the activations",
    "rank_train": "of the activations on training batches",
    "weight": "of the weight matrices",
    "jacobian": "of the network up to each block",
}
_CENTERED = "centered_"


def _metric_words(metric: str) -> tuple[str, str, str | None]:
    """``(title, axis label, reduction in words or None)`` of a metric key such as ``"channel/variance_ratio_10"``."""
    reduction, _, family = metric.rpartition("/")
    if reduction and reduction not in _REDUCTIONS:
        return metric, metric, None
    centred = family.startswith(_CENTERED)
    family = family.removeprefix(_CENTERED)
    words = _FAMILIES.get(family)
    if words is None:
        for pattern, title, axis in _PARAMETRIC:
            match = pattern.fullmatch(family)
            if match:
                words = title.format(*match.groups()), axis.format(*match.groups())
                break
    if words is None:
        name = metric.rpartition("/")[2]
        return name, name, _REDUCTIONS.get(reduction)
    title, axis = words
    if centred:
        title, axis = f"{title}, centred", f"{axis}, centred"
    return title, axis, _REDUCTIONS.get(reduction)


def figure_title(namespace: str, metric: str) -> str:
    """A figure's title in words: what the metric is, of what, and the activations' reduction.

    Known metric families (``numerical_rank``, ``soft_rank``, ``participation_ratio``, ``stable_rank``,
    ``effective_rank``, ``variance_ratio_<k>``, ``tcv``, ``tcv_normalized``, ``classwise_variance_ratio_<k>_mean``,
    ``..._class_<c>``, ``spectral_norm``, ``tail_error_k<k>``, the Jacobian's ``rank``, ``rank_max``,
    ``rank_input_<i>``; a ``centered_`` prefix; a reduction prefix ``flatten/``, ``channel/``, ``token/``, ``cls/``,
    ``mean/``) and namespaces (``rank``, ``rank_train``, ``weight``, ``jacobian``) are put in words; anything else is
    shown as it is.

    Example: ``figure_title("rank", "channel/numerical_rank")`` is ``"Numerical rank of the activations (channels:
    every spatial position a sample)"``.
    """
    title, _, reduction = _metric_words(metric)
    where = _NAMESPACES.get(namespace, f"({namespace})")
    return f"{title} {where}" + (f" ({reduction})" if reduction else "")


def axis_label(metric: str) -> str:
    """The value axis label of a metric key, with its unit (``"numerical rank (dimensions)"``)."""
    return _metric_words(metric)[1]


_SPLITS = {"val": "validation set", "train": "training batches", "test": "test set"}
_KNOWN_FACTS = ("split", "samples", "reduction", "rank_tolerance", "tolerance_size", "tolerance_dtype", "measured")
# Reductions with several rows per input (every spatial position or token a row, SPEC "Conventions").
_ROWS_PER_INPUT = {"channel", "token"}
# Coarser than float32: their tolerance is their eps alone (functional.default_rank_tolerance; named here because
# figure workers draw without importing torch).
_COARSE_DTYPES = ("bfloat16", "float16")


def _tolerance_text(rank_tolerance: Any, tolerance_size: Any, tolerance_dtype: Any = None, measured: Any = None) -> str:
    if rank_tolerance is not None:
        value = f"{rank_tolerance:.3g}" if isinstance(rank_tolerance, float) else str(rank_tolerance)
        return f"rank tolerance: eps = {value} (relative to $s_1$)"
    if tolerance_size not in ("min", "max") and tolerance_dtype is None:
        return "rank tolerance: default"
    size = f" \u00d7 {tolerance_size}(rows, columns)" if tolerance_size in ("min", "max") else ""
    if tolerance_dtype is not None:
        tolerance_dtype = str(tolerance_dtype).removeprefix("torch.")
    if tolerance_dtype == "input":
        values = measured or "activations"
        return f"rank tolerance: eps of the {values}' dtype" + (f" ({size.strip()} for float32)" if size else "")
    if tolerance_dtype in _COARSE_DTYPES:  # K-free: see default_rank_tolerance
        return f"rank tolerance: {tolerance_dtype} eps"
    return f"rank tolerance: {tolerance_dtype or 'float32'} eps{size}" + (
        " (default)" if tolerance_dtype is None else ""
    )


def caption_text(facts: Mapping[str, Any]) -> str:
    """The caption line of a figure: how the values were measured, from whatever ``facts`` are known.

    Args:
        facts: any of ``split`` (``"val"``, ``"train"``, ``"test"`` or words), ``samples`` (N, the number of samples
            measured; shown as inputs where a reduction makes each position or token a row), ``reduction`` (a
            string, or a mapping from the kind of activations to its reduction, such as
            ``{"conv maps": "channel", "tokens": "token"}``),
            ``rank_tolerance`` (a float, or ``None`` for the default), ``tolerance_size`` (``"min"``/``"max"``, the
            ``K`` of the default tolerance), ``tolerance_dtype`` (whose ``eps`` the default tolerance takes:
            ``None`` for float32, ``"input"`` or a dtype name) and ``measured`` (``"activations"``, the default, or
            ``"weights"``: whose dtype ``"input"`` is); any other key is shown as ``"<key>: <value>"``.
            ``None`` values are left out, except ``rank_tolerance=None``, which means the default tolerance.

    Returns:
        The parts joined by ``" · "``; an empty string when nothing is known.
    """
    parts = []
    if facts.get("split") is not None:
        parts.append(f"split: {_SPLITS.get(facts['split'], facts['split'])}")
    samples, reduction = facts.get("samples"), facts.get("reduction")
    if samples is not None:
        # Under a reduction whose rows are positions or tokens, N counts the inputs, not the rows of the spectra.
        reductions = reduction.values() if isinstance(reduction, Mapping) else [reduction]
        unit = "inputs" if any(isinstance(r, str) and r in _ROWS_PER_INPUT for r in reductions) else "samples"
        parts.append(f"N = {samples:,} {unit}" if isinstance(samples, int) else f"N = {samples}")
    if isinstance(reduction, Mapping):
        reduction = ", ".join(f"{name} ({kind})" for kind, name in reduction.items())
    if reduction:
        parts.append(f"reduction: {reduction}")
    if "rank_tolerance" in facts or facts.get("tolerance_size") is not None:
        parts.append(
            _tolerance_text(
                facts.get("rank_tolerance"),
                facts.get("tolerance_size"),
                facts.get("tolerance_dtype"),
                facts.get("measured"),
            )
        )
    parts += [f"{key.replace('_', ' ')}: {v}" for key, v in facts.items() if key not in _KNOWN_FACTS and v is not None]
    return " · ".join(parts)


# -- lines that can be told apart --------------------------------------------------------------------------------------

_MARKERS = ("o", "s", "^", "D", "v", "P")
_LINESTYLES = ("-", "--", ":", "-.")
# Upper ends of the sequential maps at which lines still contrast 3:1 with white (plasma: orange-red, viridis: teal).
_LAYER_MAP, _LAYER_MAP_END = "plasma", 0.62
MAX_NAMED_LAYERS = 24
"""Above this many layers a figure names every k-th layer only (depth ticks) and shows depth by a colour bar instead
of a legend entry per layer: the legend of a 72-layer transformer took most of the figure's drawing time and could
not be read."""
_EPOCH_MAP, _EPOCH_MAP_END = "viridis", 0.58
_MIN_CONTRAST = 3.0


def contrast_on_white(color: Sequence[float]) -> float:
    """WCAG contrast ratio of an RGB(A) colour (components in ``[0, 1]``) against white: 1 (white) to 21 (black)."""
    channels = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in color[:3]]
    luminance = 0.2126 * channels[0] + 0.7152 * channels[1] + 0.0722 * channels[2]
    return 1.05 / (luminance + 0.05)


def _darkened(color: Sequence[float]) -> tuple[float, ...]:
    """``color`` scaled towards black until it contrasts at least 3:1 with white."""
    rgb = tuple(color[:3])
    while contrast_on_white(rgb) < _MIN_CONTRAST:
        rgb = tuple(0.92 * c for c in rgb)
    return (*rgb, 1.0)


def line_styles(count: int, ordered: bool = True) -> list[dict[str, Any]]:
    """Keyword arguments of ``Axes.plot`` (``color``, ``marker``, ``linestyle``) for ``count`` lines.

    Every colour contrasts at least 3:1 with white. ``ordered`` lines (layers by depth) take their colour from the
    dark part of a perceptual map, from deep blue (first) to orange-red (last), so colour reads as depth; markers cycle
    with every line and line styles with every sixth, so that neighbours differ and 24 lines have distinct
    marker/style pairs. Unordered lines (runs) take ten distinct dark colours, then the next line style.
    """
    if ordered:
        colormap = colormaps[_LAYER_MAP]
        colors = [colormap(_LAYER_MAP_END * i / max(count - 1, 1)) for i in range(count)]
        return [
            dict(color=colors[i], marker=_MARKERS[i % len(_MARKERS)], linestyle=_LINESTYLES[i // 6 % 4])
            for i in range(count)
        ]
    palette = [_darkened(colormaps["tab10"](i)) for i in range(10)]
    return [dict(color=palette[i % 10], marker="o", linestyle=_LINESTYLES[i // 10 % 4]) for i in range(count)]


def _epoch_colors(epochs: Sequence[int]) -> list[Any]:
    colormap = colormaps[_EPOCH_MAP]
    trained = [e for e in epochs if e != INITIAL_EPOCH]
    steps = max(len(trained) - 1, 1)
    colors, index = [], 0
    for epoch in epochs:
        if epoch == INITIAL_EPOCH:
            colors.append("black")
        else:
            colors.append(colormap(_EPOCH_MAP_END * index / steps))
            index += 1
    return colors


# -- axes ------------------------------------------------------------------------------------------------------------

# Text metrics of the default font (DejaVu Sans) in inches, for margins computed without measuring texts.
_FONT = 10
_TICK_FONT = 9
_CHAR = 0.068  # average width of a character at 9 points
_LINE = 0.2  # height of a line of 9-10 point text
_TITLE_Y = 1.0
"""Height of the panel titles, at the top of their axes. Given explicitly, matplotlib no longer measures the axes'
tick labels on every draw to lift the title above top tick labels, which these axes do not have: 5% fewer instructions
per figure, the same pixels."""
_VALUE_BINS = 6
"""At most this many intervals between value ticks (the automatic locator's steps, fewer ticks): 5-7 ticks where it
put 9-11 on a 3.4 inch panel, the same on both panels of a figure. A tick is five artists made at draw time: 7% fewer
instructions per figure."""


def _epoch_axis(axes: Axes, epochs: Sequence[int]) -> None:
    """Integer epoch ticks; with an initial point, a first tick at -1 labelled ``init``."""
    if INITIAL_EPOCH not in epochs:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        return
    last = max(epochs)
    ticks = [t for t in MaxNLocator(nbins=6, integer=True).tick_values(0, max(last, 0)) if 0 <= t <= last]
    if last >= 10:
        ticks = [t for t in ticks if t != 0]  # "init" and "0" would overlap
    axes.xaxis.set_major_locator(FixedLocator([INITIAL_EPOCH, *ticks]))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: "init" if round(x) == INITIAL_EPOCH else f"{x:g}"))


def _names_fit(names: Sequence[str], width: float) -> bool:
    """Whether ``names`` fit side by side, horizontally, as tick labels of an axis ``width`` inches wide."""
    longest = max((len(name) for name in names), default=0)
    return longest * _CHAR <= 0.9 * width / max(len(names), 1)


def _layer_tick_height(layers: Sequence[str], width: float) -> float:
    """Height in inches of the layer tick labels that :func:`_layer_ticks` writes."""
    if _names_fit(layers, width):
        return _LINE
    return 0.71 * _CHAR * max((len(layer) for layer in layers), default=0) + _LINE


def _named_layers(layers: Sequence[str]) -> list[str]:
    """The layers whose names a figure shows: all of them, or every k-th (first and last included) above
    :data:`MAX_NAMED_LAYERS`."""
    if len(layers) <= MAX_NAMED_LAYERS:
        return list(layers)
    return [layers[i] for i in _named_positions(len(layers))]


def _named_positions(count: int) -> list[int]:
    step = math.ceil(count / MAX_NAMED_LAYERS)
    positions = list(range(0, count, step))
    # The last layer is always named; a k-th layer closer to it than a step would print over its name.
    if count - 1 - positions[-1] < step and len(positions) > 1:
        positions.pop()
    return sorted({*positions, count - 1})


def _layer_ticks(axes: Axes, layers: Sequence[str]) -> None:
    """Layer names as x tick labels (every k-th of many): horizontal when they fit, else rotated by 45 degrees."""
    width = axes.get_position().width * axes.figure.get_figwidth()
    positions = list(range(len(layers))) if len(layers) <= MAX_NAMED_LAYERS else _named_positions(len(layers))
    names = [layers[i] for i in positions]
    axes.set_xticks(positions)
    if _names_fit(names, width):
        axes.set_xticklabels(names, fontsize=_TICK_FONT)
    else:
        axes.set_xticklabels(names, fontsize=_TICK_FONT, rotation=45, ha="right", rotation_mode="anchor")


def _depth_colorbar(axes: Axes, layers: Sequence[str]) -> None:
    """A colour bar beside ``axes`` that maps the line colours of :func:`line_styles` to the depth index of the
    depth panel (instead of a legend entry for each of many layers)."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, Normalize

    colors = [style["color"] for style in line_styles(len(layers))]
    mappable = ScalarMappable(norm=Normalize(0, len(layers) - 1), cmap=ListedColormap(colors))
    bar = axes.figure.colorbar(mappable, ax=axes, pad=0.03, fraction=0.08)
    ticks = sorted({0, (len(layers) - 1) // 2, len(layers) - 1})
    bar.set_ticks(ticks)
    bar.set_ticklabels([str(i) for i in ticks], fontsize=_TICK_FONT)
    bar.ax.set_title("layer", fontsize=_TICK_FONT, y=_TITLE_Y)


def _legend_beside(axes: Axes, labels: Sequence[str], title: str | None = None) -> None:
    """A legend to the right of ``axes``, in as many columns as its height needs."""
    height = axes.get_position().height * axes.figure.get_figheight()
    columns = _legend_size(labels, int(height / _LINE) - (1 if title else 0))[0]
    axes.legend(
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0,
        fontsize=_TICK_FONT,
        ncol=columns,
        frameon=False,
        title=title,
        title_fontsize=_TICK_FONT,
    )


def _legend_size(labels: Sequence[str], rows: int) -> tuple[int, float]:
    """Columns and width (inches) of a legend of ``labels`` with at most ``rows`` rows."""
    columns = max(math.ceil(len(labels) / max(rows, 1)), 1)
    longest = max((len(label) for label in labels), default=0)
    return columns, columns * (0.55 + _CHAR * longest) + 0.1


def _wrapped(text: str | None, width: float, char: float = _CHAR) -> list[str]:
    """``text`` broken into lines of at most ``width`` inches (``char``: inches per character)."""
    return textwrap.wrap(text, width=max(int(width / char), 20)) if text else []


def _value(history: History, epoch: int, layer: str, metric: str) -> float:
    return history[epoch].get(layer, {}).get(metric, math.nan)


# -- one run ---------------------------------------------------------------------------------------------------------

_PANEL_HEIGHT = 3.4  # at least; taller when the layer legend would need more than two columns (at most 8 inches)
_EPOCH_PANEL_WIDTH = 6.0
_LEFT = 0.85  # room for the value axis' tick labels and label
_TOP = 0.85  # room for a line of title and the panel titles
_TITLE_FONT = 13
_TITLE_CHAR = 0.1  # average width of a character at 13 points


def _two_panels(
    title: str, caption: str | None, layers: Sequence[str], epoch_names: Sequence[str]
) -> tuple[Figure, Axes, Axes]:
    """The figure of :func:`layer_curves_figure` with its two panels, margins sized from the texts around them.

    The layer legend (beside the first panel) gets up to two columns by making the panels taller (at most 8
    inches), the depth panel 0.3 inch per layer, the bottom margin the layer names and the caption.
    """
    many = len(layers) > MAX_NAMED_LAYERS
    named = _named_layers(layers)
    panel_height = min(max(_PANEL_HEIGHT, (math.ceil(len(named) / 2) + 1) * _LINE + 0.1), 8.0)
    rows = int(panel_height / _LINE) - 1
    depth_width = max(6.0, 0.3 * len(named))
    legend_width = 1.2 if many else _legend_size(layers, rows)[1]
    depth_left = _LEFT + _EPOCH_PANEL_WIDTH + legend_width + 0.95
    width = depth_left + depth_width + _legend_size(epoch_names, rows)[1] + 0.2
    caption_lines = _wrapped(caption, width - _LEFT - 0.2)
    caption_height = len(caption_lines) * _LINE + (0.25 if caption_lines else 0)
    bottom = 0.1 + caption_height + _layer_tick_height(named, depth_width) + 0.45
    title_lines = _wrapped(title, width - 0.4, _TITLE_CHAR)
    height = bottom + panel_height + _TOP + 0.25 * (len(title_lines) - 1)
    figure = Figure(figsize=(width, height))
    figure.suptitle("\n".join(title_lines), fontsize=_TITLE_FONT, y=1 - 0.1 / height, va="top")
    if caption_lines:
        figure.text(_LEFT / width, 0.1 / height, "\n".join(caption_lines), fontsize=_TICK_FONT, color="0.2")
    by_epoch = figure.add_axes((_LEFT / width, bottom / height, _EPOCH_PANEL_WIDTH / width, panel_height / height))
    by_depth = figure.add_axes((depth_left / width, bottom / height, depth_width / width, panel_height / height))
    return figure, by_epoch, by_depth


def layer_curves_figure(
    namespace: str,
    metric: str,
    layers: Sequence[str],
    history: History,
    *,
    max_depth_curves: int = 8,
    x_label: str = "epoch",
    caption: str | None = None,
    reference: Reference | None = None,
) -> Figure:
    """One metric of one run: against epoch (a line per layer) beside against depth (a line per epoch).

    The title is :func:`figure_title`, the value axes :func:`axis_label`; layers are told apart by
    :func:`line_styles` and listed beside the first panel; epoch ``-1`` is drawn as ``init``. A ``reference`` (a
    theory's prediction per layer, :class:`Reference`) is drawn over the depth panel as a thick dark-green dash-dotted
    line (unlike any epoch's line) and, when it is the same for every layer (a bound such as ``sqrt(width)``), across
    the epoch panel too.

    Args:
        namespace: the curves' namespace (``"rank"``, ``"weight"``, ...), named in the title.
        metric: the metric drawn (its key).
        layers: layers in depth order.
        history: ``epoch -> layer -> metric -> value``.
        max_depth_curves: at most this many epochs (evenly spaced) in the depth panel.
        x_label: name of the history's keys (``"epoch"``, ``"step"``).
        caption: a line under the panels saying how the values were measured (:func:`caption_text`).
        reference: the prediction to draw beside the measured curves; layers it does not name are skipped.
    """
    epochs = sorted(history)
    depth_epochs = evenly_spaced(epochs, max_depth_curves)
    epoch_names = [epoch_label(e) if x_label == "epoch" else f"{x_label} {e}" for e in depth_epochs]
    legend_names = epoch_names if reference is None else [*epoch_names, reference.label]
    figure, by_epoch, by_depth = _two_panels(figure_title(namespace, metric), caption, layers, legend_names)
    for axes in (by_epoch, by_depth):
        axes.set_ylabel(axis_label(metric), fontsize=_FONT)
        axes.tick_params(labelsize=_TICK_FONT)
        axes.grid(alpha=0.3)
        axes.yaxis.set_major_locator(MaxNLocator(nbins=_VALUE_BINS, steps=[1, 2, 2.5, 5, 10]))

    many = len(layers) > MAX_NAMED_LAYERS
    for layer, style in zip(layers, line_styles(len(layers))):
        xs = [e for e in epochs if metric in history[e].get(layer, {})]
        if xs:
            ys = [history[e][layer][metric] for e in xs]
            if many:
                style = dict(style, marker=None, linestyle="-", linewidth=0.9)
            by_epoch.plot(xs, ys, markersize=4, markevery=max(1, math.ceil(len(xs) / 15)), label=layer, **style)
    _epoch_axis(by_epoch, epochs)
    by_epoch.set_xlabel(x_label, fontsize=_FONT)
    by_epoch.set_title(
        f"against {x_label}, one line per layer (blue: input side, red: output side)", fontsize=_FONT, y=_TITLE_Y
    )
    if many:
        _depth_colorbar(by_epoch, layers)
    else:
        _legend_beside(by_epoch, layers, title="layer")

    for epoch, name, color in zip(depth_epochs, epoch_names, _epoch_colors(depth_epochs)):
        values = [_value(history, epoch, layer, metric) for layer in layers]
        style = "--" if epoch == INITIAL_EPOCH else "-"
        by_depth.plot(range(len(layers)), values, marker="o", markersize=4, color=color, linestyle=style, label=name)
    _layer_ticks(by_depth, layers)
    by_depth.set_xlabel("layer (input to output)", fontsize=_FONT)
    by_depth.set_title(f"against depth, one line per {x_label} (purple: early, teal: late)", fontsize=_FONT, y=_TITLE_Y)
    if reference is not None:
        _draw_reference(by_epoch, by_depth, layers, reference)
    _legend_beside(by_depth, legend_names)
    return figure


@dataclass(frozen=True)
class Reference:
    """A theory's prediction of one metric per layer, drawn beside the measured curves (:func:`layer_curves_figure`).

    Build one with :func:`theorem5_reference` (Feng et al. Theorem 5: the numerical rank of a deep Gaussian product)
    or :func:`sqrt_width_reference` (Daneshmand et al. Theorem 2: the ``sqrt(width)`` order of ``r(H)`` and
    ``rank_0.5`` in batch-normalised networks), or from any ``{layer: value}``.

    Attributes:
        values: ``layer -> predicted value``.
        label: the legend entry (``"Theorem 5"``).
    """

    values: Mapping[str, float]
    label: str

    def __post_init__(self) -> None:
        bad = {layer: value for layer, value in self.values.items() if not isinstance(value, (int, float))}
        if not self.values or bad:
            raise ValueError(f"a reference needs numbers for one or more layers, got {dict(self.values)!r}")


def theorem5_reference(layers: Sequence[str], width: int, *, first_depth: int = 1, **tolerance: Any) -> Reference:
    """Feng et al. Theorem 5's numerical rank of the ``l``-th of ``layers`` (depth ``first_depth + l``) for a product
    of square Gaussian matrices of size ``width`` (:func:`~rank_lightning.functional.gaussian_product_numerical_rank`,
    whose ``rank_tolerance`` can be passed)."""
    from rank_lightning.functional.theory import gaussian_product_numerical_rank

    values = {
        layer: float(gaussian_product_numerical_rank(width, first_depth + index, **tolerance))
        for index, layer in enumerate(layers)
    }
    return Reference(values, "Theorem 5")


def sqrt_width_reference(layers: Sequence[str], width: int) -> Reference:
    """``sqrt(width)`` at every layer: the order Daneshmand et al. Theorem 2 gives ``r(H)`` and ``rank_0.5`` of
    batch-normalised networks at any depth (vanilla networks fall towards 1)."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive integer, got {width!r}")
    return Reference(dict.fromkeys(layers, math.sqrt(width)), f"√width = {math.sqrt(width):.3g} (Theorem 2)")


_REFERENCE_COLOR = "#1b7837"  # dark green: no epoch colour (purple to teal) nor layer colour is near it


def _draw_reference(by_epoch: Axes, by_depth: Axes, layers: Sequence[str], reference: Reference) -> None:
    positions = [(index, reference.values[layer]) for index, layer in enumerate(layers) if layer in reference.values]
    if not positions:
        return
    style = {"color": _REFERENCE_COLOR, "linestyle": "-.", "linewidth": 2.2, "zorder": 5}
    by_depth.plot([p for p, _ in positions], [v for _, v in positions], label=reference.label, **style)
    values = {v for _, v in positions}
    if len(values) == 1:
        by_epoch.axhline(values.pop(), **style)


# -- several runs (analysis.report) ----------------------------------------------------------------------------------

# One run's curve of one metric: layer -> {epoch: value}.
RunCurve = Mapping[str, Mapping[int, float]]


def _runs_figure(width: float, height: float, title: str, caption: str | None) -> Figure:
    """A constrained-layout figure with ``title`` and, below everything, the wrapped ``caption``."""
    lines = _wrapped(caption, width - 0.4)
    caption_height = len(lines) * _LINE + (0.2 if lines else 0)
    figure = Figure(figsize=(width, height + caption_height), layout="constrained")
    figure.suptitle("\n".join(_wrapped(title, width - 0.4, _TITLE_CHAR)), fontsize=_TITLE_FONT)
    if lines:
        total = height + caption_height
        figure.get_layout_engine().set(rect=(0, caption_height / total, 1, 1 - caption_height / total))
        figure.text(0.2 / width, 0.1 / total, "\n".join(lines), fontsize=_TICK_FONT, color="0.2")
    return figure


def runs_vs_epoch_figure(
    namespace: str,
    metric: str,
    layers: Sequence[str],
    runs: Mapping[str, RunCurve],
    *,
    caption: str | None = None,
    x_label: str = "epoch",
) -> Figure:
    """One panel per layer, the metric against epoch, one line per run (``runs``: label -> layer -> epoch -> value).

    Titled by :func:`figure_title`; runs are told apart by :func:`line_styles` (unordered); epoch ``-1`` is ``init``;
    ``caption`` (:func:`caption_text`) goes under the panels. ``x_label`` names what the curves are keyed by
    (``"epoch"``, or ``"step"`` for curves keyed by optimizer step).
    """
    columns = min(4, len(layers))
    rows = math.ceil(len(layers) / columns)
    figure = _runs_figure(3.8 * columns, 2.8 * rows + 0.8, f"{figure_title(namespace, metric)}, per layer", caption)
    axes = figure.subplots(rows, columns, squeeze=False, sharex=True)
    styles = line_styles(len(runs), ordered=False)
    epochs = sorted({e for curves in runs.values() for curve in curves.values() for e in curve})
    for index, layer in enumerate(layers):
        ax = axes[index // columns][index % columns]
        for curves, style in zip(runs.values(), styles):
            curve = curves.get(layer, {})
            if curve:
                xs = sorted(curve)
                ax.plot(xs, [curve[e] for e in xs], markersize=3, markevery=max(1, math.ceil(len(xs) / 15)), **style)
        ax.set_title(layer, fontsize=_FONT)
        _epoch_axis(ax, epochs)
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.tick_params(labelsize=_TICK_FONT)
        ax.grid(alpha=0.3)
    for index in range(len(layers), rows * columns):
        axes[index // columns][index % columns].set_axis_off()
    for column in range(columns):
        lowest = max(index for index in range(len(layers)) if index % columns == column)
        axes[lowest // columns][column].set_xlabel(x_label, fontsize=_FONT)
        axes[lowest // columns][column].xaxis.set_tick_params(labelbottom=True)  # shared axes hide inner labels
    figure.supylabel(axis_label(metric), fontsize=_FONT)
    if len(runs) > 1:
        handles = [Line2D([], [], markersize=4, **style) for style in styles]
        figure.legend(handles, list(runs), loc="outside right upper", fontsize=_TICK_FONT, title="run")
    return figure


def runs_vs_depth_figure(
    namespace: str,
    metric: str,
    layers: Sequence[str],
    runs: Mapping[str, tuple[int | None, RunCurve]],
    *,
    caption: str | None = None,
    x_labels: Mapping[str, str] | None = None,
) -> Figure:
    """The metric at each run's last epoch against depth (``runs``: label -> (last epoch, layer -> epoch -> value)).

    Titled by :func:`figure_title`; layer names are horizontal when they fit, else rotated; ``caption``
    (:func:`caption_text`) goes under the panel. ``x_labels`` (label -> ``"epoch"`` or ``"step"``) says which runs'
    curves are keyed by optimizer step (by default none).
    """
    x_labels = x_labels or {}
    axes_used = set(x_labels.values()) | ({"epoch"} if set(runs) - set(x_labels) else set())
    point = axes_used.pop() if len(axes_used) == 1 else "point"
    width = max(7.0, 0.3 * len(layers))
    title = f"{figure_title(namespace, metric)}, against depth at each run's last {point}"
    figure = _runs_figure(width, 4.5 + _layer_tick_height(layers, width), title, caption)
    ax = figure.subplots()
    for (label, (last, curves)), style in zip(runs.items(), line_styles(len(runs), ordered=False)):
        values = [curves.get(layer, {}).get(last, math.nan) for layer in layers]
        axis = x_labels.get(label, "epoch")
        at = f"no {axis}" if last is None else epoch_label(last) if axis == "epoch" else f"{axis} {last}"
        name = f"{label} ({at})"
        ax.plot(range(len(layers)), values, markersize=4, label=name, **style)
    _layer_ticks(ax, layers)
    ax.set_xlabel("layer (input to output)", fontsize=_FONT)
    ax.set_ylabel(axis_label(metric), fontsize=_FONT)
    ax.tick_params(labelsize=_TICK_FONT)
    ax.legend(fontsize=_TICK_FONT)
    ax.grid(alpha=0.3)
    return figure


# -- method-specific figures -----------------------------------------------------------------------------------------


def adversarial_figure(
    curves: Mapping[str, Mapping[str, Sequence[float]]],
    levels: Sequence[float],
    clean_accuracy: float,
    title: str,
    feature_layer: str | None = None,
) -> Figure:
    """Misclassification against L2 dissimilarity per attack (Sanyal et al. Fig. 5), beside ``D_Adv`` against eps.

    Args:
        curves: ``attack -> {"acc": [...], "l2": [...], "d_adv": [...]}``, one value per budget.
        levels: the budgets in grey levels, ascending.
        clean_accuracy: accuracy on the clean inputs (the first point of every curve).
        title: what the figure shows (stage and epoch).
        feature_layer: name of the layer of ``D_Adv``; ``None`` draws the first panel only.
    """
    with_d_adv = feature_layer is not None
    figure = Figure(figsize=(12 if with_d_adv else 6.5, 4.8), layout="constrained")
    panels = figure.subplots(1, 2 if with_d_adv else 1, squeeze=False)[0]
    figure.suptitle(f"Adversarial robustness ({title})")
    colors = colormaps["tab10"]
    for i, (name, curve) in enumerate(curves.items()):
        errors = [1 - acc for acc in curve["acc"]]
        distances = list(curve["l2"])
        panels[0].plot([0.0, *distances], [1 - clean_accuracy, *errors], marker="o", color=colors(i), label=name)
        for level, x, y in zip(levels, distances, errors):
            panels[0].annotate(f"{level:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize="x-small")
        if with_d_adv:
            panels[1].plot(levels, list(curve["d_adv"]), marker="o", color=colors(i), label=name)
    panels[0].set_xlabel("normalised L2 dissimilarity ||x_a - x_d|| / ||x_d|| (Sanyal eq. 10)")
    panels[0].set_ylabel("misclassification rate")
    panels[0].set_ylim(-0.02, 1.02)
    panels[0].set_title("labels: eps in grey levels; first point: clean inputs", fontsize="medium")
    if with_d_adv:
        panels[1].set_xscale("symlog", linthresh=1.0)
        panels[1].set_xticks(list(levels), [f"{level:g}" for level in levels])
        panels[1].set_xlabel("eps (grey levels)")
        panels[1].set_ylabel(f"D_Adv at {feature_layer}")
        panels[1].set_title("mean ||f(x_a) - f(x_d)||^2 over originally correct samples", fontsize="medium")
    for panel in panels:
        panel.grid(alpha=0.3)
        panel.legend(fontsize="small")
    return figure


def classification_dimension_figure(
    ks: Sequence[int],
    accuracies: Sequence[float],
    eigenvalues: Sequence[float],
    *,
    cls_dim: int,
    ambient_dim: int,
    full_accuracy: float,
    threshold: float,
    centered: bool,
) -> Figure:
    """Accuracy of the head on top-k projections against k, beside the PCA spectrum (Feng et al. eq. 6, Table 2)."""
    figure = Figure(figsize=(12, 4.5))
    figure.subplots_adjust(left=0.07, right=0.98, top=0.86, bottom=0.12, wspace=0.22)
    accuracy_axes, spectrum_axes = figure.subplots(1, 2)
    how = "centred" if centered else "uncentred"
    figure.suptitle(f"classification dimension {cls_dim} / {ambient_dim} ({how} projection)")
    accuracy_axes.plot(list(ks), list(accuracies), marker=".", label="top-k projection")
    accuracy_axes.axhline(full_accuracy, color="black", lw=0.8, label="full accuracy")
    accuracy_axes.axhline(threshold * full_accuracy, color="gray", ls="--", lw=0.8, label=f"{threshold} x full")
    defined = math.isfinite(cls_dim)  # NaN for features without principal directions (constant or non-finite)
    if defined:
        accuracy_axes.axvline(cls_dim, color="red", ls=":", label=f"cls_dim = {cls_dim}")
    if any(math.isfinite(value) for value in accuracies):  # a log axis needs a point to scale
        accuracy_axes.set_xscale("log")
    accuracy_axes.set_xlabel("k (principal directions)")
    accuracy_axes.set_ylabel("accuracy of the model's head")
    accuracy_axes.legend(fontsize="small")
    accuracy_axes.grid(alpha=0.3)
    # Rounding leaves the null directions at tiny or negative values, which a log axis cannot show.
    positive = [(i + 1, v) for i, v in enumerate(eigenvalues) if v > 0]
    spectrum_axes.plot([i for i, _ in positive], [v for _, v in positive], marker=".")
    if defined:
        spectrum_axes.axvline(cls_dim, color="red", ls=":")
    if positive:  # a log axis needs a positive value
        spectrum_axes.set_yscale("log")
        spectrum_axes.set_xscale("log")
    spectrum_axes.set_xlabel("principal direction")
    spectrum_axes.set_ylabel("eigenvalue of the feature covariance")
    spectrum_axes.grid(alpha=0.3)
    return figure
