"""A planted corpus for the cleaning stage: English prose, foreign documents, exact and near copies."""

import json
import os
import re

FOREIGN = {
    'de': ['Der Zug nach Hamburg fährt heute wegen eines Unwetters mit einer Stunde Verspätung ab.',
           'Meine Großmutter hat jeden Sonntag einen Apfelkuchen für die ganze Familie gebacken.',
           'Die Stadtverwaltung möchte im nächsten Jahr mehr Radwege in der Innenstadt bauen.',
           'Im Herbst sammeln die Kinder bunte Blätter und Kastanien im Park hinter der Schule.',
           'Das Museum zeigt eine Ausstellung über die Geschichte der Schifffahrt auf dem Rhein.',
           'Wir haben uns entschieden, den Urlaub dieses Jahr in den Bergen zu verbringen.',
           'Nach dem langen Winter freuen sich alle auf die ersten warmen Tage im Frühling.',
           'Der Bäcker an der Ecke öffnet schon um sechs Uhr morgens und hat frische Brötchen.'],
    'fr': ['Le marché du samedi matin attire toujours beaucoup de monde sur la place du village.',
           'Ma sœur a décidé de reprendre ses études de médecine après plusieurs années de travail.',
           'Les enfants ont construit une cabane dans le jardin avec de vieilles planches en bois.',
           'La bibliothèque municipale restera fermée pendant les travaux de rénovation cet été.',
           'Nous avons mangé une excellente soupe à l\'oignon dans un petit restaurant du quartier.',
           'Le train pour Lyon part à huit heures et il faut arriver à la gare un peu en avance.',
           'Chaque hiver, les oiseaux viennent chercher des graines sur le rebord de la fenêtre.',
           'Il a plu toute la journée, alors nous sommes restés à la maison pour lire des romans.'],
    'es': ['El mercado central abre todos los días desde muy temprano y vende fruta fresca.',
           'Mi abuelo cuenta historias de cuando trabajaba como pescador en un pueblo de la costa.',
           'Los estudiantes prepararon una obra de teatro para celebrar el final del curso escolar.',
           'La ciudad ha plantado cientos de árboles nuevos en las avenidas durante la primavera.',
           'Después de la cena salimos a caminar por la playa mientras se ponía el sol.',
           'El autobús llega con retraso porque hay obras en la carretera que va al aeropuerto.',
           'Mi hermana aprendió a tocar la guitarra sola, mirando vídeos por las noches.',
           'En verano hace tanto calor que la gente prefiere salir de paseo por la noche.'],
    'it': ['La nonna prepara la pasta fatta in casa ogni domenica per tutta la famiglia.',
           'Il treno per Milano è partito in ritardo a causa di un guasto sulla linea.',
           'I bambini giocano a calcio nel cortile della scuola durante la ricreazione.',
           'Abbiamo visitato un piccolo borgo medievale sulle colline vicino a Siena.',
           'Il museo della città ospita una mostra dedicata ai pittori del Rinascimento.',
           'Dopo una lunga giornata di lavoro mi piace leggere un libro sul balcone.',
           'In autunno i boschi si colorano di rosso e di giallo e si raccolgono le castagne.',
           'Il panettiere sotto casa apre alle sei e vende pane caldo e cornetti.'],
    'nl': ['De bakker op de hoek verkoopt elke ochtend vers brood en heerlijke appeltaart.',
           'Mijn broer fietst iedere dag naar zijn werk, ook als het hard regent.',
           'In de zomer gaan we vaak met de hele familie naar het strand bij Scheveningen.',
           'De gemeente wil volgend jaar meer bomen planten in de straten van het centrum.',
           'De kinderen hebben een hut gebouwd in het bos achter de school van het dorp.',
           'Het museum heeft een nieuwe tentoonstelling over de geschiedenis van de haven.',
           'Na een lange winter kijkt iedereen uit naar de eerste warme dagen van de lente.',
           'De trein naar Amsterdam vertrekt vandaag met een vertraging van een half uur.'],
}


def _paragraphs() -> list[str]:
  """Distinct prose paragraphs of Python's own documentation (pydoc topics), in a stable order."""
  import pydoc_data.topics  # pylint: disable=g-import-not-at-top  # the stdlib's language reference, offline
  seen, out = set(), []
  for _, text in sorted(pydoc_data.topics.topics.items()):
    for p in text.split('\n\n'):
      if p.startswith(' ') or any(c in p for c in ('>>>', '::', '{', '|', '=', '…')) or re.search(r'\d', p):
        continue  # code and tables
      # Prose without markup: reference docs quote code inline, which is no English to a quality filter.
      p = ' '.join(re.sub(r'[()\[\]"“”‘’`*_<>:;]', '', line).strip() for line in p.splitlines())
      if len(p.split()) >= 25 and p.endswith('.') and p not in seen:
        seen.add(p)
        out.append(p)
  return out


def _near(text: str, k: int) -> str:
  """A near copy: a few words changed."""
  words = text.split(' ')
  for i in range(7 + k, len(words), 90):
    words[i] = ('really', 'quite', 'indeed', 'also')[(i + k) % 4]
  return ' '.join(words)


def write(root, english: int = 100, copies: int = 15) -> dict:
  """Writes docs.jsonl (and a parquet of the foreign part) under `root`; returns the ids of each kind."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  os.makedirs(root, exist_ok=True)
  paras = _paragraphs()
  docs = []  # (id, text)
  pool = iter(paras[0::7] + paras[1::7] + paras[2::7] + paras[3::7] + paras[4::7] + paras[5::7] + paras[6::7])
  for i in range(english):  # each paragraph once; neighbours in a document come from distant topics
    parts = [next(pool), next(pool)]
    while sum(p.count('. ') + 1 for p in parts) < 6:
      parts.append(next(pool))
    docs.append((f'en-{i}', '\n'.join(parts)))
  for i in range(copies):  # exact copies of the first documents, near copies of the next ones
    docs.append((f'en-{i}-exact', docs[i][1]))
    docs.append((f'en-{copies + i}-near', _near(docs[copies + i][1], i)))
  foreign = []
  for lang, sentences in FOREIGN.items():
    for i in range(6):
      order = sentences[i % 8:] + sentences[:i % 8]
      foreign.append((f'{lang}-{i}', ' '.join(order[:6 + i % 3])))
  with open(os.path.join(root, 'docs.jsonl'), 'w') as f:
    for doc_id, text in docs[::2] + foreign[::2]:
      f.write(json.dumps({'id': doc_id, 'text': text}) + '\n')
  with open(os.path.join(root, 'more.jsonl'), 'w') as f:
    for doc_id, text in docs[1::2]:
      f.write(json.dumps({'id': doc_id, 'text': text}) + '\n')
  pq.write_table(pa.table({'id': [d for d, _ in foreign[1::2]], 'text': [t for _, t in foreign[1::2]]}),
                 os.path.join(root, 'foreign.parquet'))
  return {'english': english, 'copies': copies, 'foreign': [d for d, _ in foreign], 'all': docs + foreign}
