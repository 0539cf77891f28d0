"""The artifact schema: what every JSON file under results/ holds (schema.py), the RUN records
inside a bench artifact (runs.py), and the blocks that say where one came from (provenance.py).
Imports no other room of the study."""
