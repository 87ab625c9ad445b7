"""make_mesh: shapes, axis types and the errors for impossible shapes."""

import jax
import pytest
from jax.sharding import AxisType

from ulysses_jax.mesh import DATA, SEQ, make_mesh


@pytest.mark.parametrize("data,seq,expected", [(-1, 1, (8, 1)), (-1, 4, (2, 4)), (2, 4, (2, 4)),
                                               (1, 8, (1, 8)), (-1, 8, (1, 8))])
def test_shapes(data, seq, expected):
  mesh = make_mesh(data=data, seq=seq)
  assert (mesh.shape[DATA], mesh.shape[SEQ]) == expected
  assert mesh.axis_names[:1] == (DATA,) and SEQ in mesh.axis_names
  assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_explicit_devices():
  mesh = make_mesh(data=1, seq=2, devices=jax.devices()[:2])
  assert mesh.devices.size == 2


@pytest.mark.parametrize("kwargs,message", [
    (dict(seq=3), r"seq=3 does not divide the 8 available devices"),
    (dict(data=3, seq=2), r"mesh data=3 x seq=2 needs 6 devices but 8 are available"),
    (dict(seq=0), r"seq must be >= 1, got 0"),
    (dict(data=0, seq=2), r"data must be >= 1 or -1"),
])
def test_impossible_shapes_are_rejected(kwargs, message):
  with pytest.raises(ValueError, match=message):
    make_mesh(**kwargs)
