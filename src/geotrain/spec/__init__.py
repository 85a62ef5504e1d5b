"""Validated, typed configuration: clusters, models and jobs read from TOML.

Everything downstream (cost model, planner, simulator, runtime) takes these frozen objects,
never raw dictionaries, so a spec is checked once, here, with errors that name file and field.
"""

from geotrain.spec.cluster import Cluster, Datacenter, GPUType, WanLink
from geotrain.spec.document import spec_document, spec_from_document
from geotrain.spec.job import JobSpec
from geotrain.spec.load import Spec, check_fits, check_shape, load_cluster, load_model, load_spec, validate_file
from geotrain.spec.model import ModelSpec

__all__ = [
    "Cluster", "Datacenter", "GPUType", "WanLink", "JobSpec", "ModelSpec", "Spec",
    "check_fits", "check_shape", "load_cluster", "load_model", "load_spec", "spec_document", "spec_from_document",
    "validate_file",
]
