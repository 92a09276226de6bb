import math

import numpy as np
import pytest
import torch
from sklearn.decomposition import PCA
from sklearn.linear_model import Lasso
from torch import nn

from rank_lightning.functional.classification import (
    classification_dimension,
    independence_deficit,
    independence_deficit_markdown,
)

D = 12  # feature width
M = 3  # informative directions


def _planted_features(num_samples: int = 3000, seed: int = 0, offset: float = 0.0):
    """Features with exactly M informative directions, hidden by a random rotation, and a linear head using only them.

    The latent z has scales 5, 4, 3 (so PCA ranks its directions first); the other D - M directions are unit noise
    that the head ignores. Classes are the sign and index of the largest |z_j|, so each of the M directions decides a
    sixth of the samples or more. With ``offset`` a constant feature is added that the head uses as its bias: the
    bias term of the head cancels it, so only a projection that keeps the mean keeps the logits.
    """
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(num_samples, M, generator=gen) * torch.tensor([5.0, 4.0, 3.0])
    noise = torch.randn(num_samples, D - M, generator=gen)
    latent = torch.cat([z, noise], dim=1)
    weight_latent = torch.zeros(2 * M, D)
    weight_latent[:M, :M] = torch.eye(M)
    weight_latent[M:, :M] = -torch.eye(M)
    bias = torch.zeros(2 * M)
    if offset:
        latent[:, -1] = offset  # a zero-variance feature: the last principal direction
        weight_latent[0, -1] = 1.0
        bias[0] = -offset
    rotation, _ = torch.linalg.qr(torch.randn(D, D, generator=gen))
    features = latent @ rotation.T
    head = nn.Linear(D, 2 * M)
    with torch.no_grad():
        head.weight.copy_(weight_latent @ rotation.T)
        head.bias.copy_(bias)
    labels = (z.abs().argmax(dim=1) + M * (z.gather(1, z.abs().argmax(dim=1, keepdim=True)).squeeze(1) < 0)).long()
    return features, labels, head


@pytest.mark.parametrize("center", [False, True])
def test_classification_dimension_finds_the_informative_directions(center):
    features, labels, head = _planted_features()
    result = classification_dimension(features, labels, head, center=center)
    assert result.full_accuracy == 1.0
    assert result.cls_dim == M
    assert result.ambient_dim == D
    assert result.ks.tolist() == list(range(1, D + 1))
    assert result.accuracies[M - 1] >= 0.95
    assert result.accuracies[M - 2] < 0.95
    assert torch.all(result.eigenvalues[:-1] >= result.eigenvalues[1:])


@pytest.mark.parametrize("center", [False, True])
def test_accuracy_curve_matches_sklearn_pca_projections(center):
    features, labels, head = _planted_features(num_samples=800, seed=1, offset=2.0)
    result = classification_dimension(features, labels, head, center=center, batch_size=300)
    x = features.double().numpy()
    for k in (1, 2, 4, 7, D):
        pca = PCA(n_components=k, svd_solver="full").fit(x)
        components = pca.components_  # (k, D): top-k eigenvectors of the covariance
        if center:
            projected = pca.inverse_transform(pca.transform(x))
        else:
            projected = x @ components.T @ components
        with torch.no_grad():
            logits = head(torch.from_numpy(projected).float())
        expected = float((logits.argmax(dim=1) == labels).double().mean())
        assert result.accuracies[k - 1].item() == pytest.approx(expected, abs=1.5 / len(labels))


def test_uncentred_projection_loses_the_mean_and_centred_keeps_it():
    features, labels, head = _planted_features(offset=10.0)
    centred = classification_dimension(features, labels, head, center=True)
    uncentred = classification_dimension(features, labels, head, center=False)
    assert centred.cls_dim == M
    # The head needs the constant feature, the direction of zero variance, which comes last.
    assert uncentred.cls_dim == D
    assert uncentred.accuracies[M - 1] < 0.95


def test_coarse_grid_reports_the_first_grid_point_reaching_the_threshold():
    features, labels, head = _planted_features()
    result = classification_dimension(features, labels, head, ks=[1, 2, 5, 10], center=True)
    assert result.ks.tolist() == [1, 2, 5, 10, D]
    assert result.cls_dim == 5
    # With one direction about 40% of the samples are right, with two about 70%.
    lenient = classification_dimension(features, labels, head, ks=[1, 2, 5], threshold=0.6, center=True)
    assert lenient.cls_dim == 2
    assert lenient.accuracies[0] < 0.6 <= lenient.accuracies[1]


def test_classification_dimension_rejects_bad_arguments():
    features, labels, head = _planted_features(num_samples=50)
    with pytest.raises(ValueError, match=r"ks must lie in \[1, 12\]"):
        classification_dimension(features, labels, head, ks=[0, 3])
    with pytest.raises(ValueError, match="threshold"):
        classification_dimension(features, labels, head, threshold=1.5)
    with pytest.raises(ValueError, match="labels must have shape"):
        classification_dimension(features, labels[:-1], head)


@pytest.mark.parametrize("center", ["yes", 1, None])
def test_classification_dimension_rejects_a_center_that_is_not_a_bool(center):
    features, labels, head = _planted_features(num_samples=50)
    with pytest.raises(ValueError, match=f"unknown center {center!r}; valid choices are: False, True"):
        classification_dimension(features, labels, head, center=center)


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("value", [0.0, 3.0])
def test_constant_features_have_no_classification_dimension(center, value):
    # A layer of dead ReLUs (value 0) or a saturated one: no principal direction, so no smallest k.
    features, labels = torch.full((50, 8), value), torch.arange(50) % 5
    head = nn.Linear(8, 5)
    with pytest.warns(RuntimeWarning, match="the features are constant"):
        result = classification_dimension(features, labels, head, center=center)
    assert math.isnan(result.cls_dim) and not result.defined
    assert result.ks.tolist() == list(range(1, 9))
    assert torch.isnan(result.accuracies).all()
    assert torch.equal(result.eigenvalues, torch.zeros(8, dtype=torch.float64))
    with torch.no_grad():
        expected = float((head(features).argmax(dim=1) == labels).double().mean())
    assert result.full_accuracy == expected


def test_features_varying_only_in_one_row_still_have_a_classification_dimension():
    features, labels = torch.zeros(50, 8), torch.arange(50) % 5
    features[7, 2] = 1e-30  # tiny, but not rounding: one principal direction
    result = classification_dimension(features, labels, nn.Linear(8, 5))
    assert result.defined and result.cls_dim in range(1, 9)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_features_give_nan_instead_of_failing(bad):
    features, labels = torch.randn(40, 6, generator=torch.Generator().manual_seed(0)), torch.arange(40) % 4
    features[3, 1] = bad
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        result = classification_dimension(features, labels, nn.Linear(6, 4))
    assert math.isnan(result.cls_dim) and math.isnan(result.full_accuracy) and not result.defined
    assert torch.isnan(result.accuracies).all() and torch.isnan(result.eigenvalues).all()
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        all_nan = classification_dimension(torch.full((40, 6), math.nan), labels, nn.Linear(6, 4))
    assert math.isnan(all_nan.cls_dim)


def _planted_logits(num_samples: int = 2000, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((num_samples, 6)) * np.array([3.0, 2.0, 1.0, 2.5, 1.5, 2.0])
    logits[:, 2] = 1.5 * logits[:, 0] - 0.8 * logits[:, 4] + 0.01 * rng.standard_normal(num_samples)
    labels = logits.argmax(axis=1)
    flip = rng.random(num_samples) < 0.2
    labels[flip] = rng.integers(0, 6, flip.sum())
    return torch.from_numpy(logits).float(), torch.from_numpy(labels)


def test_lasso_recovers_a_planted_linear_dependence():
    logits, labels = _planted_logits()
    (row,) = independence_deficit(logits, labels, classes=[2], eta=0.01)
    assert row["class"] == 2
    assert row["terms"] == [0, 4]
    assert row["weights"] == pytest.approx([1.5, -0.8], abs=0.02)
    assert row["r2"] > 0.999
    assert row["relative_residual"] < 0.02
    z = logits.double().numpy()
    y = labels.numpy()
    assert row["accuracy"] == pytest.approx(float((z.argmax(1) == y).mean()))
    replaced = z.copy()
    replaced[:, 2] = 1.5 * z[:, 0] - 0.8 * z[:, 4]
    assert row["accuracy_fit"] == pytest.approx(float((replaced.argmax(1) == y).mean()), abs=3 / len(y))
    in_class = y == 2
    assert row["class_accuracy"] == pytest.approx(float((z[in_class].argmax(1) == 2).mean()))


def test_lasso_solves_the_documented_objective():
    """KKT conditions of mean_x (y - X lambda)^2 + eta ||lambda||_1: |2/N X^T r| <= eta, = eta sign(lambda) on the
    support. A wrong conversion to scikit-learn's alpha (e.g. alpha = eta) breaks them by a factor 2."""
    logits, labels = _planted_logits(seed=3)
    eta = 0.5
    rows = independence_deficit(logits, labels, eta=eta, tol=1e-10)
    # Class 2 depends on 0 and 4: some weights are non-zero and some are zero, so both conditions are exercised.
    assert 0 < rows[2]["num_terms"] < 5
    for row in rows:
        i = row["class"]
        z = logits.double().numpy()
        others = [j for j in range(6) if j != i]
        weights = np.zeros(5)
        for term, weight in zip(row["terms"], row["weights"]):
            weights[others.index(term)] = weight
        residual = z[:, i] - z[:, others] @ weights
        gradient = 2 / len(z) * z[:, others].T @ residual
        support = weights != 0
        np.testing.assert_allclose(gradient[support], eta * np.sign(weights[support]), atol=1e-4)
        assert np.all(np.abs(gradient[~support]) <= eta + 1e-4)
        objective = np.mean(residual**2) + eta * np.abs(weights).sum()
        assert row["objective"] == pytest.approx(objective)


def test_fit_on_class_samples_matches_a_direct_lasso_fit():
    logits, labels = _planted_logits(seed=4)
    (row,) = independence_deficit(logits, labels, classes=[3], eta=0.2, fit_on="class")
    z = logits.double().numpy()
    rows = labels.numpy() == 3
    others = [0, 1, 2, 4, 5]
    reference = Lasso(alpha=0.1, fit_intercept=False, tol=1e-8, max_iter=100_000).fit(z[rows][:, others], z[rows, 3])
    expected = {others[k]: w for k, w in enumerate(reference.coef_) if w != 0}
    assert dict(zip(row["terms"], row["weights"])) == pytest.approx(expected, abs=1e-4)


def test_independence_deficit_markdown_table():
    logits, labels = _planted_logits()
    rows = independence_deficit(logits, labels, classes=[2, 5], eta=0.01)
    names = ["cat", "dog", "bird", "frog", "ship", "car"]
    table = independence_deficit_markdown(rows, names, max_terms=1)
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| bird | +1.4")
    assert "x cat (+1 more)" in lines[2]
    assert lines[0].count("|") == lines[2].count("|")


def test_independence_deficit_rejects_bad_arguments():
    logits, labels = _planted_logits(num_samples=50)
    with pytest.raises(ValueError, match=r"classes \[7\] are out of range; valid classes are 0..5"):
        independence_deficit(logits, labels, classes=[7])
    with pytest.raises(ValueError, match="unknown fit_on 'pos'"):
        independence_deficit(logits, labels, fit_on="pos")
    nan_logits = logits.clone()
    nan_logits[4, 2] = math.nan
    with pytest.raises(ValueError, match="logits contain NaN or Inf values"):
        independence_deficit(nan_logits, labels)


def test_accuracy_with_a_replaced_logit_matches_a_direct_argmax():
    logits, labels = _planted_logits(seed=5)
    logits = logits.round()  # ties between logits exercise argmax's first-index rule
    z = logits.double().numpy()
    y = labels.numpy()
    for row in independence_deficit(logits, labels, eta=0.3):
        i = row["class"]
        replaced = z.copy()
        replaced[:, i] = sum(w * z[:, j] for j, w in zip(row["terms"], row["weights"]))
        predicted = replaced.argmax(axis=1)
        assert row["accuracy_fit"] == float((predicted == y).mean())
        assert row["class_accuracy_fit"] == float((predicted[y == i] == i).mean())


def test_classification_dimension_rejects_non_integer_ks_instead_of_truncating():
    features, labels, head = _planted_features(num_samples=50)
    with pytest.raises(ValueError, match=r"ks must be integers in \[1, 12\] \(the feature width\), got \[2\.5, 5\]"):
        classification_dimension(features, labels, head, ks=[2.5, 5])
    with pytest.raises(ValueError, match=r"got \[True, 5\]"):
        classification_dimension(features, labels, head, ks=[True, 5])
    # Integer tensors and NumPy integers are integers.
    by_tensor = classification_dimension(features, labels, head, ks=torch.tensor([2, 5]))
    by_numpy = classification_dimension(features, labels, head, ks=np.array([2, 5]))
    assert by_tensor.ks.tolist() == by_numpy.ks.tolist() == [2, 5, 12]
