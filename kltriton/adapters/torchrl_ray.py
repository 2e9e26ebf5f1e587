"""Ray service variants of the torchrl drop-ins: one actor computes the KL for many environments.

``RetrieveKL(..., use_ray_service=True)`` and ``KLRewardTransform(..., use_ray_service=True)`` return
these, as torchrl's do. They are torchrl's public ``RayTransform`` (actor reuse by name, device
mapping, local parent/container handling) around a remote kltriton transform:

- the models are built on the actor from ``*_model_factory`` callables (never serialized), or sent
  once when passed directly;
- ``actor_name=`` names the actor; every client with that name shares it (created once, detached, so it
  outlives the client that made it: ``ray.kill(ray.get_actor(name))`` removes it);
- ``num_cpus`` (default 1) and ``num_gpus`` (default 0) reserve the actor's resources, ``device`` is
  where the actor computes;
- results come back on the device of the caller's tensordict.

Needs Ray (the ``[ray]`` extra).
"""
try:
    import ray
except ImportError as err:  # pragma: no cover - exercised only without the extra
    from kltriton._install import pip_install

    raise ImportError(f"use_ray_service=True needs Ray: {pip_install('ray')}") from err

from torchrl.envs.transforms import RayTransform

from kltriton.adapters.torchrl import KLRewardTransform, RetrieveKL

__all__ = ["RayKLRewardTransform", "RayRetrieveKL"]


def _both(model, factory, name: str) -> None:
    if model is not None and factory is not None:
        raise ValueError(f"Cannot provide both '{name}' and '{name}_factory'. Choose one.")


class _RayService(RayTransform):
    """A ``RayTransform`` whose actor is ``_LOCAL_CLASS(**actor_kwargs)``; outputs go back to the caller's device."""

    _LOCAL_CLASS = None

    def __init__(self, *, num_cpus=None, num_gpus=0, device=None, actor_name=None, actor_kwargs):
        if device is not None:
            actor_kwargs["device"] = device
        super().__init__(num_cpus=1 if num_cpus is None else num_cpus, num_gpus=num_gpus, device=None,
                         actor_name=actor_name, actor_kwargs=actor_kwargs)

    def _create_actor(self, *, actor_kwargs, **kwargs):
        options = {}
        if self._actor_name is not None:
            options = dict(name=self._actor_name, lifetime="detached", get_if_exists=True)
        remote = ray.remote(num_cpus=self._num_cpus, num_gpus=self._num_gpus)(self._LOCAL_CLASS)
        return remote.options(**options).remote(**actor_kwargs)

    def forward(self, tensordict):
        return _back_on(tensordict, super().forward(tensordict))

    def _step(self, tensordict, next_tensordict):
        return _back_on(next_tensordict, super()._step(tensordict, next_tensordict))

    def _reset(self, tensordict, tensordict_reset):
        return _back_on(tensordict_reset, super()._reset(tensordict, tensordict_reset))


def _back_on(source, result):
    """``result`` (a CPU tensordict from the actor) on ``source``'s device."""
    device = source.device if source is not None else None
    return result if device is None or result is None else result.to(device)


class RayRetrieveKL(_RayService):
    """``RetrieveKL`` in a shared Ray actor; same arguments plus ``gen_model_factory``/``ref_model_factory``
    (built on the actor), ``num_cpus``, ``num_gpus``, ``device`` (the actor's) and ``actor_name``."""

    _LOCAL_CLASS = RetrieveKL

    def __init__(self, gen_model="from_collector", ref_model=None, *, gen_model_factory=None, ref_model_factory=None,
                 num_cpus=None, num_gpus=0, device=None, actor_name=None, **kwargs):
        from_collector = isinstance(gen_model, str) and gen_model == "from_collector"
        if from_collector and gen_model_factory is None:
            raise ValueError("gen_model='from_collector' needs the collector, which lives in this process, not in the "
                             "Ray actor: pass gen_model_factory (or gen_model) with use_ray_service=True")
        _both(None if from_collector else gen_model, gen_model_factory, "gen_model")
        _both(ref_model, ref_model_factory, "ref_model")
        actor_kwargs = dict(kwargs, gen_model=None if gen_model_factory is not None else gen_model, ref_model=ref_model,
                            gen_model_factory=gen_model_factory, ref_model_factory=ref_model_factory)
        super().__init__(num_cpus=num_cpus, num_gpus=num_gpus, device=device, actor_name=actor_name,
                         actor_kwargs=actor_kwargs)


class RayKLRewardTransform(_RayService):
    """``KLRewardTransform`` in a shared Ray actor; same arguments plus ``ref_model_factory`` (built on the
    actor), ``num_cpus``, ``num_gpus``, ``device`` (the actor's) and ``actor_name``."""

    _LOCAL_CLASS = KLRewardTransform

    def __init__(self, ref_model=None, *, ref_model_factory=None, num_cpus=None, num_gpus=0, device=None,
                 actor_name=None, **kwargs):
        _both(ref_model, ref_model_factory, "ref_model")
        if ref_model is None and ref_model_factory is None:
            raise ValueError("Must provide exactly one of 'ref_model' or 'ref_model_factory'.")
        actor_kwargs = dict(kwargs, ref_model=ref_model, ref_model_factory=ref_model_factory)
        super().__init__(num_cpus=num_cpus, num_gpus=num_gpus, device=device, actor_name=actor_name,
                         actor_kwargs=actor_kwargs)
