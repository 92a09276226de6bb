import pytest
import torch

from rank_lightning.analysis.structural_impetus import COMPONENTS, build_component, main, structural_impetus

CHANNELS, SIZE, GROUPS = 4, 4, 2
DIM = CHANNELS * SIZE * SIZE


@pytest.fixture(scope="module")
def rows():
    result = structural_impetus(
        channels=CHANNELS, size=SIZE, num_samples=2 * DIM, groups=GROUPS, heads=2, dtype=torch.float64
    )
    return {row.component: row for row in result}


def test_every_component_is_measured_from_a_full_rank_start(rows):
    assert list(rows) == list(COMPONENTS)
    for row in rows.values():
        assert row.feature_rank_before == row.jacobian_rank_before == DIM
        assert row.dim_after == DIM
        # Feng et al. Theorem 2: no component raises the rank.
        assert row.feature_rank_after <= DIM and row.jacobian_rank_after <= DIM


def test_normalisation_layers_lose_their_invariant_directions(rows):
    """Per normalised group the output is invariant to a shift of the input: one Jacobian direction lost per group,
    and the features satisfy one linear constraint (zero mean) per group. The output is invariant to a rescaling only
    up to the epsilon of the normalisation, which leaves a singular value of about eps / variance relative to the
    others: above this small tolerance (7.6e-6 at d = 64) it counts, at the default d = 1024 (1.2e-4) it does not."""
    expected_groups = {"layernorm": 1, "groupnorm": GROUPS, "instancenorm": CHANNELS}
    for name, groups in expected_groups.items():
        row = rows[name]
        assert groups <= DIM - row.jacobian_rank_after <= 2 * groups, name
        assert DIM - row.feature_rank_after == groups, name
    # BatchNorm is an affine map per channel for one input: nothing is lost.
    assert rows["batchnorm"].jacobian_rank_after == rows["batchnorm"].feature_rank_after == DIM


def test_relu_keeps_the_features_but_halves_the_jacobian(rows):
    relu = rows["relu"]
    assert relu.feature_rank_after == DIM
    # The Jacobian keeps only the rows of active units, about half of them.
    assert 0.25 * DIM < relu.jacobian_rank_after < 0.75 * DIM
    assert rows["gelu"].feature_rank_after == DIM


def test_attention_component_maps_tokens():
    module = build_component("attention", CHANNELS, SIZE, heads=2)
    assert module(torch.randn(3, CHANNELS, SIZE, SIZE)).shape == (3, SIZE * SIZE, CHANNELS)
    with pytest.raises(ValueError, match="unknown component 'pool'; components are: linear, conv3x3"):
        build_component("pool", CHANNELS, SIZE)


def test_command_line_prints_a_markdown_table(capsys):
    argv = ["--channels", "4", "--size", "4", "--samples", "64", "--groups", "2", "--heads", "2"]
    main([*argv, "--components", "layernorm", "relu"])
    out = capsys.readouterr().out
    assert "| layernorm | 64 | 64 | 63 | 1 | 64 | 63 | 1 |" in out
    assert "| relu |" in out
    with pytest.raises(SystemExit):
        main(["--channels", "4", "--size", "4", "--samples", "10"])
