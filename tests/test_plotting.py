"""Figures a researcher can show: titles in words, units, legible ticks, dark distinguishable lines, a caption."""

from __future__ import annotations

import io
import itertools
import math

import matplotlib
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox
from PIL import Image

from rank_lightning import plotting
from rank_lightning.plotting import (
    INITIAL_EPOCH,
    axis_label,
    caption_text,
    contrast_on_white,
    epoch_label,
    figure_title,
    layer_curves_figure,
    line_styles,
    runs_vs_depth_figure,
    runs_vs_epoch_figure,
    save_figure,
)

CHANNELS = "(channels: every spatial position a sample)"


@pytest.mark.parametrize(
    ("namespace", "metric", "title"),
    [
        ("rank", "channel/numerical_rank", f"Numerical rank of the activations {CHANNELS}"),
        ("rank", "participation_ratio", "Participation ratio r(H) of the activations"),
        (
            "rank_train",
            "token/soft_rank",
            "Soft rank of the activations on training batches (tokens: every token a sample)",
        ),
        (
            "rank",
            "flatten/variance_ratio_10",
            "Variance ratio VR$_{10}$ of the activations (flattened: one vector per sample)",
        ),
        (
            "rank",
            "mean/tcv_normalized",
            "Normalised total cluster variation of the activations (mean over positions or tokens)",
        ),
        (
            "rank",
            "cls/classwise_variance_ratio_1_mean",
            "Class-wise variance ratio VR$_{1}$, mean over classes of the activations (first (CLS) token)",
        ),
        (
            "rank",
            "classwise_variance_ratio_10_class_3",
            "Class-wise variance ratio VR$_{10}$ of class 3 of the activations",
        ),
        ("rank", "centered_effective_rank", "Effective rank, centred of the activations"),
        ("weight", "stable_rank", "Stable rank of the weight matrices"),
        ("weight", "spectral_norm", "Spectral norm of the weight matrices"),
        ("weight", "tail_error_k50", "Tail error beyond rank 50 of the weight matrices"),
        ("jacobian", "rank", "Partial Jacobian rank of the network up to each block"),
        ("jacobian", "rank_input_2", "Partial Jacobian rank at input 2 of the network up to each block"),
        ("mine", "odd/name", "odd/name (mine)"),
    ],
)
def test_titles_say_in_words_what_is_drawn(namespace, metric, title):
    assert figure_title(namespace, metric) == title


@pytest.mark.parametrize(
    ("metric", "label"),
    [
        ("channel/numerical_rank", "numerical rank (dimensions)"),
        ("participation_ratio", "r(H) (dimensions)"),
        ("variance_ratio_1", "VR$_{1}$ (fraction of the variance)"),
        ("tcv", "TCV (squared distance to the class means)"),
        ("tcv_normalized", "TCV / total sum of squares (fraction)"),
        ("spectral_norm", "largest singular value $s_1$"),
        ("tail_error_k10", "relative Frobenius error of the best rank-10 approximation"),
        ("something_else", "something_else"),
    ],
)
def test_value_axes_carry_units(metric, label):
    assert axis_label(metric) == label


def test_the_caption_states_split_samples_reduction_and_tolerance():
    facts = {"split": "val", "samples": 4096, "reduction": "channel", "rank_tolerance": 1e-6, "seed": 3, "note": None}
    assert caption_text(facts) == (
        "split: validation set · N = 4,096 inputs · reduction: channel · rank tolerance: eps = 1e-06 (relative to "
        "$s_1$) · seed: 3"
    )
    assert caption_text({"split": "train", "rank_tolerance": None}) == (
        "split: training batches · rank tolerance: default"
    )
    assert caption_text({"tolerance_size": "max"}) == "rank tolerance: float32 eps \u00d7 max(rows, columns) (default)"
    # N counts inputs where each of their tokens or positions is a row of the spectra, else samples (rows).
    tokens = {"samples": 16, "reduction": {"tokens": "token"}}
    assert caption_text(tokens) == "N = 16 inputs · reduction: token (tokens)"
    pooled = {"samples": 16, "reduction": {"conv maps": "mean", "tokens": "cls"}}
    assert caption_text(pooled).startswith("N = 16 samples")
    assert caption_text({"samples": 16, "reduction": "flatten"}).startswith("N = 16 samples")
    assert caption_text({}) == ""


@pytest.mark.parametrize("count", [1, 2, 5, 24, 60])
def test_layer_lines_are_dark_and_neighbours_differ(count):
    styles = line_styles(count)
    assert len(styles) == count
    assert min(contrast_on_white(style["color"]) for style in styles) >= 3.0
    for before, after in itertools.pairwise(styles):
        assert before["marker"] != after["marker"] and before["color"] != after["color"]
    pairs = {(style["marker"], style["linestyle"]) for style in styles[:24]}
    assert len(pairs) == min(count, 24)


def test_run_lines_are_dark_and_distinct():
    styles = line_styles(25, ordered=False)
    assert min(contrast_on_white(style["color"]) for style in styles) >= 3.0
    assert len({(tuple(style["color"]), style["linestyle"]) for style in styles}) == 25
    assert len({tuple(style["color"]) for style in styles[:10]}) == 10


def test_contrast_on_white_matches_the_wcag_formula():
    assert contrast_on_white((1.0, 1.0, 1.0)) == pytest.approx(1.0)
    assert contrast_on_white((0.0, 0.0, 0.0)) == pytest.approx(21.0)
    assert contrast_on_white((0.5, 0.5, 0.5, 1.0)) == pytest.approx(3.98, abs=0.01)


def _history(layers: list[str], epochs: range, metric: str = "m") -> dict[int, dict[str, dict[str, float]]]:
    return {e: {layer: {metric: 10 + math.sin(e + i)} for i, layer in enumerate(layers)} for e in epochs}


def _drawn(figure: Figure) -> Figure:
    FigureCanvasAgg(figure).draw()
    return figure


def _extent(artist) -> Bbox:
    return artist.get_window_extent(artist.figure.canvas.get_renderer())


def _assert_readable(figure: Figure) -> None:
    """Every text lies inside the figure, no smaller than 9 points; tick labels overlap no axis label or caption."""
    frame = figure.bbox
    texts = [t for t in figure.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_fontsize")) if t.get_text()]
    texts = [t for t in texts if t.get_visible()]
    for text in texts:
        box = _extent(text)
        assert frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1, text.get_text()
        assert frame.y0 - 1 <= box.y0 and box.y1 <= frame.y1 + 1, text.get_text()
        assert text.get_fontsize() >= 9, text.get_text()
    captions = [t for t in figure.texts if t.get_text()]
    for axes in figure.axes:
        labels = [_extent(t) for t in axes.get_xticklabels() if t.get_text()]
        below = [_extent(axes.xaxis.label), *(_extent(c) for c in captions)]
        for label in labels:
            assert not any(label.overlaps(box) for box in below if box.width > 0)


@pytest.mark.parametrize(
    ("layers", "rotation"),
    [
        (["fc1", "fc2", "act"], 0),
        ([f"layer{i}" for i in range(1, 9)], 0),
        ([f"backbone.layer{i // 3 + 1}.{i % 3}.conv2" for i in range(24)], 45),
    ],
    ids=["3-short", "8-blocks", "24-long"],
)
def test_one_run_figure_is_titled_in_words_readable_and_captioned(layers, rotation):
    caption = caption_text({"split": "val", "samples": 4096, "reduction": "channel", "tolerance_size": "min"})
    figure = _drawn(
        layer_curves_figure("rank", "channel/m", layers, _history(layers, range(12), "channel/m"), caption=caption)
    )
    assert _suptitle(figure) == "m of the activations " + CHANNELS
    by_epoch, by_depth = figure.axes
    assert by_epoch.get_ylabel() == by_depth.get_ylabel() == "m"
    assert by_epoch.get_xlabel() == "epoch"
    assert [t.get_text() for t in by_depth.get_xticklabels()] == layers
    assert {t.get_rotation() for t in by_depth.get_xticklabels()} == {rotation}
    assert [t.get_text() for t in by_epoch.get_legend().get_texts()] == layers
    assert caption in [text.get_text().replace("\n", " ") for text in figure.texts]
    lines = by_epoch.get_lines() + by_depth.get_lines()
    assert len(lines) == len(layers) + 8
    assert min(contrast_on_white(to_rgba(line.get_color())) for line in lines) >= 3.0
    _assert_readable(figure)
    renderer = figure.canvas.get_renderer()
    assert not _extent(by_epoch.get_legend()).overlaps(by_depth.get_tightbbox(renderer))


def test_many_layers_get_a_depth_colour_bar_and_every_kth_name():
    layers = [f"encoder.layers.{i}.self_attention.out_proj" for i in range(60)]
    figure = _drawn(layer_curves_figure("rank", "m", layers, _history(layers, range(12), "m")))
    by_epoch, by_depth, bar = figure.axes
    # Every third layer named, first and last included, at its depth index; 57 is left out, its name would overlap
    # the last layer's (two positions apart).
    named = [*range(0, 57, 3), 59]
    assert list(by_depth.get_xticks()) == named
    assert [t.get_text() for t in by_depth.get_xticklabels()] == [layers[i] for i in named]
    assert by_epoch.get_legend() is None
    assert [t.get_text() for t in bar.get_yticklabels()] == ["0", "29", "59"]
    lines = by_epoch.get_lines() + by_depth.get_lines()
    assert len(lines) == 60 + 8
    assert min(contrast_on_white(to_rgba(line.get_color())) for line in lines) >= 3.0
    _assert_readable(figure)
    renderer = figure.canvas.get_renderer()
    assert not bar.get_tightbbox(renderer).overlaps(by_depth.get_tightbbox(renderer))


def test_the_initial_point_starts_the_epoch_axis_as_init():
    layers = ["a", "b"]
    figure = _drawn(layer_curves_figure("weight", "m", layers, _history(layers, range(-1, 30))))
    by_epoch, by_depth = figure.axes
    ticks = [(tick, label.get_text()) for tick, label in zip(by_epoch.get_xticks(), by_epoch.get_xticklabels())]
    assert ticks[0] == (INITIAL_EPOCH, "init")
    assert "0" not in [text for _, text in ticks]  # beside "init" on a long axis, "0" would overlap it
    assert by_epoch.get_xlim()[0] <= INITIAL_EPOCH
    assert by_depth.get_legend().get_texts()[0].get_text() == "init"
    assert epoch_label(INITIAL_EPOCH) == "init" and epoch_label(3) == "epoch 3"
    short = _drawn(layer_curves_figure("weight", "m", layers, _history(layers, range(-1, 3))))
    assert [label.get_text() for label in short.axes[0].get_xticklabels()][:2] == ["init", "0"]


def test_runs_figures_are_titled_in_words_readable_and_dark():
    layers = [f"layer{i}" for i in range(1, 6)]
    runs = {
        f"lr={lr}": {layer: {e: float(e + i) for e in range(-1, 8)} for i, layer in enumerate(layers)}
        for lr in (1, 2, 3)
    }
    caption = caption_text({"split": "val", "samples": 512})
    by_epoch = _drawn(runs_vs_epoch_figure("rank", "channel/numerical_rank", layers, runs, caption=caption))
    assert _suptitle(by_epoch) == f"Numerical rank of the activations {CHANNELS}, per layer"
    assert _supylabel(by_epoch) == "numerical rank (dimensions)"
    assert [t.get_text() for t in by_epoch.texts if t.get_text() == caption] == [caption]
    for lowest in (by_epoch.axes[2], by_epoch.axes[4]):  # layer3 (nothing below it) and layer5 (below layer1)
        assert lowest.get_xticklabels()[0].get_text() == "init"
        assert lowest.get_xlabel() == "epoch"
    lines = [line for axes in by_epoch.axes for line in axes.get_lines()]
    assert len(lines) == 3 * len(layers) and min(contrast_on_white(to_rgba(line.get_color())) for line in lines) >= 3.0
    _assert_readable(by_epoch)

    last = {label: (7, curves) for label, curves in runs.items()}
    by_depth = _drawn(runs_vs_depth_figure("weight", "tail_error_k10", layers, last))
    title = "Tail error beyond rank 10 of the weight matrices, against depth at each run's last epoch"
    assert _suptitle(by_depth).replace("\n", " ") == title  # wrapped to the figure's width
    [axes] = by_depth.axes
    assert axes.get_ylabel() == "relative Frobenius error of the best rank-10 approximation"
    assert [t.get_text() for t in axes.get_xticklabels()] == layers
    assert [t.get_text() for t in axes.get_legend().get_texts()] == [
        "lr=1 (epoch 7)",
        "lr=2 (epoch 7)",
        "lr=3 (epoch 7)",
    ]
    _assert_readable(by_depth)


def _suptitle(figure: Figure) -> str:
    """The figure's title; ``Figure.get_suptitle`` is matplotlib 3.8's, and 3.7 is supported."""
    return figure.get_suptitle() if hasattr(figure, "get_suptitle") else figure._suptitle.get_text()


def _supylabel(figure: Figure) -> str:
    """The figure's y label; ``Figure.get_supylabel`` is matplotlib 3.8's, and 3.7 is supported."""
    return figure.get_supylabel() if hasattr(figure, "get_supylabel") else figure._supylabel.get_text()


def _pixels(png) -> np.ndarray:
    with Image.open(png) as image:
        return np.asarray(image.convert("RGBA"))


def _savefig_pixels(figure: Figure, dpi: int) -> np.ndarray:
    """What ``Figure.savefig`` draws with the settings that :func:`save_figure` draws with."""
    buffer = io.BytesIO()
    with matplotlib.rc_context(plotting._DRAWING_RC):
        figure.savefig(buffer, format="png", dpi=dpi)
    return _pixels(buffer)


def test_save_figure_writes_the_pixels_savefig_draws(tmp_path):
    layers = ["fc1", "fc2", "fc3"]
    caption = caption_text({"split": "val", "samples": 256, "rank_tolerance": 1e-6})  # mathtext: $s_1$
    figures = [
        layer_curves_figure(
            "rank",
            "m",
            layers,
            {e: {layer: {"m": shift + e * i} for i, layer in enumerate(layers)} for e in range(-1, 6)},
            caption=caption,
        )
        for shift in (0.0, 50.0)
    ]
    assert tuple(figures[0].get_size_inches()) == tuple(figures[1].get_size_inches())
    for index, figure in enumerate(figures):  # the second figure is drawn on the renderer of the first
        canvas = figure.canvas
        path = save_figure(figure, tmp_path / "sub" / f"{index}.png")
        assert figure.canvas is canvas and figure.dpi == 100
        written = _pixels(path)
        # The figure's size in pixels as this matplotlib's Agg canvas takes it: rounded from 3.11, truncated before
        # (a 5.45-inch height at 100 dpi, 544.99..., gives 545 rows, or 544 on 3.7 to 3.10).
        width, height = canvas.get_width_height(physical=True)
        assert abs(height - figure.get_figheight() * 100) < 1 and abs(width - figure.get_figwidth() * 100) < 1
        assert written.shape == (height, width, 4)
        np.testing.assert_array_equal(written, _savefig_pixels(figure, 100))
        with Image.open(path) as image:
            assert image.format == "PNG" and image.info["dpi"] == pytest.approx((100, 100), abs=0.01)
    assert not np.array_equal(_pixels(tmp_path / "sub" / "0.png"), _pixels(tmp_path / "sub" / "1.png"))

    small = save_figure(figures[0], tmp_path / "small.png", dpi=40)
    assert figures[0].dpi == 100
    np.testing.assert_array_equal(_pixels(small), _savefig_pixels(figures[0], 40))


def test_save_figure_writes_other_formats_through_savefig(tmp_path):
    layers = ["a", "b"]
    figure = layer_curves_figure("weight", "m", layers, _history(layers, range(-1, 4)))
    path = save_figure(figure, tmp_path / "curves.svg")
    assert path.read_bytes().lstrip().startswith(b"<?xml")


def test_value_axes_carry_few_ticks():
    """A tick costs five artists made at draw time: the value axes keep 5-7 (the automatic locator put up to 11)."""
    layers = ["a", "b", "c", "d"]
    history = {e: {layer: {"m": 40 + 20 * math.sin(e / 5 + i)} for i, layer in enumerate(layers)} for e in range(30)}
    figure = _drawn(layer_curves_figure("rank", "m", layers, history))
    for axes in figure.axes:
        low, high = axes.get_ylim()
        ticks = [tick for tick in axes.get_yticks() if low <= tick <= high]
        assert 3 <= len(ticks) <= 7, ticks


def test_classification_dimension_figure_of_features_without_directions_draws(tmp_path):
    # Constant features: cls_dim NaN and every eigenvalue 0; the log axes raised "Data cannot be log-scaled".
    figure = plotting.classification_dimension_figure(
        [1, 2, 3],
        [math.nan] * 3,
        [0.0, 0.0, 0.0],
        cls_dim=math.nan,
        ambient_dim=3,
        full_accuracy=0.2,
        threshold=0.95,
        centered=False,
    )
    path = plotting.save_figure(figure, tmp_path / "clsdim.png")
    assert path.stat().st_size > 0
    _, spectrum_axes = figure.axes
    assert spectrum_axes.get_yscale() == "linear"
