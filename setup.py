"""Which packages the wheel carries: every package under attn_spec/, found rather than listed (a list left
out attn_spec.diagnosis once), and the catalog in properties/ installed as attn_spec.properties, so no
generic top-level "properties" module lands in site-packages. The metadata is in pyproject.toml."""
from setuptools import find_packages, setup

CATALOG = "attn_spec.properties"

setup(
    packages=find_packages(include=["attn_spec", "attn_spec.*"])
    + [CATALOG] + [f"{CATALOG}.{name}" for name in find_packages("properties")],
    package_dir={CATALOG: "properties"},
)
