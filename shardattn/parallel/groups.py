"""The process group of a step, from what the caller hands around: a ``ProcessGroup`` or a ``DeviceMesh``.

Serving engines describe their parallel layout as a :class:`~torch.distributed.device_mesh.DeviceMesh`
(``init_device_mesh("cuda", (2, 8), mesh_dim_names=("dp", "tp"))``). Every entry point of
:mod:`shardattn.parallel` that takes a group (the :class:`~shardattn.runtime.runtime.Runtime`,
the steps, :func:`~shardattn.parallel.collector.collect_partials`,
:class:`~shardattn.parallel.comm.Comm`, the Ray pool's ranks) accepts, for its ``group`` argument:

* a ``torch.distributed.ProcessGroup``;
* a 1-D ``DeviceMesh`` (its only dimension's group);
* ``(mesh, dim)``: the group of dimension ``dim`` (a name of ``mesh.mesh_dim_names``, or an index)
  of an N-D mesh, e.g. ``(mesh, "tp")``; ``mesh["tp"]`` (a 1-D sub-mesh) is the same group.

:func:`resolve_group` turns any of them into the ``ProcessGroup``, once, at the boundary; anything
else is a ``TypeError`` naming the argument, and an N-D mesh without a dimension a ``ValueError``.
"""

from __future__ import annotations

from typing import Any, Union

import torch.distributed as dist

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # a torch without distributed support: no mesh can be passed
    DeviceMesh = None  # type: ignore[assignment,misc]

__all__ = ["GroupLike", "resolve_group"]

GroupLike = Union[dist.ProcessGroup, "DeviceMesh", tuple["DeviceMesh", str | int]]
"""What a ``group`` argument accepts (module docstring)."""

_EXPECTED = "a torch.distributed ProcessGroup, a 1-D DeviceMesh or (DeviceMesh, dim name)"


def _is_mesh(x: Any) -> bool:
    return DeviceMesh is not None and isinstance(x, DeviceMesh)


def _dims(mesh: Any) -> str:
    names = mesh.mesh_dim_names
    return f"dims {tuple(names)}" if names else f"{mesh.ndim} unnamed dims"


def _check_member(mesh: Any, name: str) -> None:
    """A ``ValueError`` on a process outside ``mesh`` (torch's ``get_group`` fails there with an ``IndexError``)."""
    if mesh.get_coordinate() is None:
        ranks = mesh.mesh.flatten().tolist()
        raise ValueError(
            f"{name}: this process (global rank {dist.get_rank()}) is not in the DeviceMesh (global ranks {ranks}): "
            "only the mesh's ranks run its steps"
        )


def _mesh_dim_group(mesh: Any, dim: Any, name: str) -> dist.ProcessGroup:
    names = tuple(mesh.mesh_dim_names or ())
    if isinstance(dim, str):
        if dim not in names:
            raise ValueError(f"{name}: the DeviceMesh has no dim {dim!r} ({_dims(mesh)}); name one of them")
    elif isinstance(dim, int) and not isinstance(dim, bool):
        if not 0 <= dim < mesh.ndim:
            raise ValueError(f"{name}: dim {dim} is not a dimension of the {mesh.ndim}-D DeviceMesh ({_dims(mesh)})")
    else:
        raise TypeError(f"{name}: the dim of (DeviceMesh, dim) must be a dim name or index, got {type(dim).__name__}")
    _check_member(mesh, name)
    return mesh.get_group(dim)


def resolve_group(group: Any, *, name: str = "group") -> dist.ProcessGroup:
    """The ``ProcessGroup`` of ``group`` (module docstring); ``name`` is the argument the errors name.

    Args:
        group: a ``ProcessGroup``, a 1-D ``DeviceMesh``, or ``(mesh, dim)`` (a dim name or index).
    Returns:
        the process group the step runs over (``group`` itself when it is one).
    Raises:
        TypeError: ``group`` is none of these (names ``name`` and the type it got).
        ValueError: an N-D mesh without a dimension, or a dimension the mesh does not have; the
            placeholder ``new_group`` returns on a rank outside the group, or a mesh this process is
            not in.

    >>> resolve_group("tp")
    Traceback (most recent call last):
        ...
    TypeError: group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or (DeviceMesh, dim name), got str
    """
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives a rank outside it
        raise ValueError(
            f"{name}: this process (global rank {dist.get_rank()}) is not a member of the group (new_group returned "
            "GroupMember.NON_GROUP_MEMBER here): only the group's ranks run its steps"
        )
    if isinstance(group, dist.ProcessGroup):
        return group
    if _is_mesh(group):
        if group.ndim != 1:
            dim = repr(group.mesh_dim_names[-1]) if group.mesh_dim_names else str(group.ndim - 1)
            raise ValueError(
                f"{name} is a {group.ndim}-D DeviceMesh ({_dims(group)}): pass ({name}, dim name or index), e.g. "
                f"(mesh, {dim}), naming the dimension the step runs over"
            )
        _check_member(group, name)
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and _is_mesh(group[0]):
        return _mesh_dim_group(group[0], group[1], name)
    if isinstance(group, tuple) and len(group) == 2:
        raise TypeError(f"{name}: (mesh, dim) needs a DeviceMesh first, got {type(group[0]).__name__}")
    raise TypeError(f"{name} must be {_EXPECTED}, got {type(group).__name__}")
