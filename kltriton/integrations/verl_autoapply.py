"""Importing this module applies kltriton's verl integration (``kltriton.integrations.verl.apply()``).

For verl's Ray workers, which are separate processes: ``VERL_USE_EXTERNAL_MODULES=kltriton.integrations.verl_autoapply``
makes ``import verl`` import it in every process that sets the variable (pass it to the workers, e.g. through
Ray's ``runtime_env={"env_vars": {...}}``).
"""
from kltriton.integrations import verl

patch = verl.apply()
