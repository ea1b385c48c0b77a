"""Annual average carbon intensity of electricity of a few countries (gCO2e/kWh).

Values of 2023 copied from CodeCarbon's ``codecarbon/data/private_infra/global_energy_mix.json``
(mlco2/codecarbon, MIT licence), whose source is Our World in Data's carbon intensity of
electricity (https://ourworldindata.org/grapher/carbon-intensity-electricity, from Ember and
the Energy Institute). ``WORLD`` is CodeCarbon's fallback when it has no data for a country:
475 g/kWh from the IEA's Global Energy & CO2 Status Report 2019. Keys are ISO 3166-1 alpha-3.
"""

from __future__ import annotations

__all__ = ["REGION_INTENSITY", "REGION_SOURCE", "REGION_YEAR", "WORLD"]

REGION_YEAR = 2023
REGION_SOURCE = (
    "CodeCarbon global_energy_mix.json (Our World in Data / Ember, 2023); WORLD: IEA 2019"
)
WORLD = "WORLD"

REGION_INTENSITY: dict[str, tuple[str, float]] = {
    "WORLD": ("world average (IEA 2019, CodeCarbon's fallback)", 475.0),
    "AUS": ("Australia", 548.692),
    "BRA": ("Brazil", 98.348),
    "CAN": ("Canada", 170.043),
    "CHN": ("China", 582.317),
    "DEU": ("Germany", 380.95),
    "ESP": ("Spain", 174.05),
    "FRA": ("France", 56.039),
    "GBR": ("United Kingdom", 237.589),
    "IND": ("India", 713.441),
    "ITA": ("Italy", 330.718),
    "JPN": ("Japan", 485.392),
    "KOR": ("South Korea", 430.567),
    "MEX": ("Mexico", 507.245),
    "NLD": ("Netherlands", 267.622),
    "NOR": ("Norway", 30.08),
    "POL": ("Poland", 661.926),
    "SGP": ("Singapore", 470.783),
    "SWE": ("Sweden", 40.695),
    "USA": ("United States", 369.473),
    "ZAF": ("South Africa", 707.686),
}
