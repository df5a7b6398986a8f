"""Plain data: checkpoint specs, source maps, layouts, the correspondence and plans (values
with save/load, no pickle). Imports nothing of wb above :mod:`wb.errors`."""
