import numpy as np
import pytest

from rank_lightning.analysis.theorem5 import deep_linear_mlp, main, theorem5_ranks
from rank_lightning.functional.theory import gaussian_product_numerical_rank

WIDTH, DEPTH = 24, 30
EPS32 = float(np.finfo(np.float32).eps)


def test_jacobian_rank_is_the_rank_of_the_weight_product():
    rows, rates = theorem5_ranks(WIDTH, DEPTH, seeds=[0])
    model = deep_linear_mlp(WIDTH, DEPTH, seed=0)
    product = np.eye(WIDTH)
    for index, layer in enumerate(model):
        product = layer.weight.detach().numpy() @ product
        s = np.linalg.svd(product, compute_uv=False)
        assert rows[index].jacobian_rank == int((s >= EPS32 * WIDTH * s[0]).sum())
        assert rows[index].jacobian_rank_eps64 == int((s >= np.finfo(np.float64).eps * WIDTH * s[0]).sum())
    # Ratios below about 1e-10 are rounding noise of the float64 products.
    resolved = s / s[0] > 1e-10
    assert resolved.sum() >= WIDTH // 2
    np.testing.assert_allclose(rates.numpy()[resolved], np.log(s / s[0])[resolved] / DEPTH, rtol=1e-6)


def test_ranks_decay_as_theorem5_predicts():
    rows, _ = theorem5_ranks(WIDTH, DEPTH, seeds=range(3))
    assert rows[0].jacobian_rank == rows[0].feature_rank == WIDTH
    jacobian = [r.jacobian_rank for r in rows]
    assert jacobian == sorted(jacobian, reverse=True)
    assert jacobian[-1] < 0.6 * WIDTH
    for r in rows:
        assert r.predicted_rank == gaussian_product_numerical_rank(WIDTH, r.layer)
        # Finite depth: the measured rank trails the limit law by a few units at most.
        assert r.predicted_rank - 4 <= r.jacobian_rank <= r.predicted_rank + 1
        assert abs(r.feature_rank - r.jacobian_rank) <= 1.5


def test_command_line_prints_tables_and_saves_the_figure(tmp_path, capsys):
    out = tmp_path / "theorem5.png"
    main(["--width", "12", "--depth", "8", "--seeds", "2", "--out", str(out)])
    text = capsys.readouterr().out
    assert out.stat().st_size > 1000
    assert "| 8 |" in text and "| k | measured | Theorem 5 | difference |" in text


def test_command_line_ends_with_where_it_wrote(tmp_path, capsys):
    out = tmp_path / "figures" / "t5.png"
    out.parent.mkdir()
    main(["--width", "8", "--depth", "3", "--seeds", "1", "--out", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert "1 network(s) of 3 layers in" in text
    assert f"written to {out.parent}:\n    1 figure  t5.png\n" in text


def test_on_layer_is_called_once_per_layer_and_seed():
    calls = []
    theorem5_ranks(6, 4, seeds=(0, 1), on_layer=lambda: calls.append(1))
    assert len(calls) == 8


def test_a_missing_folder_is_created_and_a_second_run_keeps_the_first_figure(tmp_path, monkeypatch, capsys):
    # The README's command, in a folder without runs/.
    monkeypatch.chdir(tmp_path)
    args = ["--width", "8", "--depth", "3", "--seeds", "1", "--quiet", "--out", "runs/theorem5.png"]
    main(args)
    first = (tmp_path / "runs" / "theorem5.png").read_bytes()
    capsys.readouterr()

    main(args)
    main(args)
    assert (tmp_path / "runs" / "theorem5.png").read_bytes() == first
    assert sorted(path.name for path in (tmp_path / "runs").iterdir()) == [
        "theorem5.png",
        "theorem5_2.png",
        "theorem5_3.png",
    ]
    text = capsys.readouterr().out
    assert f"written to {tmp_path / 'runs'} ({tmp_path / 'runs' / 'theorem5.png'} already existed):" in text
    assert "    1 figure  theorem5_3.png\n" in text


def test_a_folder_is_no_figure_and_is_refused_before_the_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--width", "8", "--depth", "3", "--seeds", "1", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert f"output file {str(tmp_path)!r} is an existing folder" in captured.err
    assert "| layer |" not in captured.out


@pytest.mark.parametrize(
    ("option", "value", "minimum"), [("--width", "1", 2), ("--samples", "0", 1), ("--depth", "x", 1)]
)
def test_a_bad_size_is_refused_naming_the_option_and_value(option, value, minimum, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([option, value, "--out", str(tmp_path / "t.png")])
    assert exit_info.value.code == 2
    assert (
        f"error: argument {option}: {value!r} is not a whole number of at least {minimum}\n" in capsys.readouterr().err
    )
    assert not (tmp_path / "t.png").exists()
