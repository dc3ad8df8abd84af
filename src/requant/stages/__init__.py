"""The stages of a quantization, in the order :func:`requant.pipeline.quantize` runs them.

Each module is one stage: what it reads, what it adds to the model or the run, and what it records
(its section of the report, and the summary lines read from that section):

- :mod:`~requant.stages.load`: the model in, canonicalized, the target's passes run (load/prepare);
- :mod:`~requant.stages.transform`: the float model evened out for int8 (smoothing, equalization);
- :mod:`~requant.stages.annotate`: the quantizers' requests on the model, placement by cost;
- :mod:`~requant.stages.run`: one run, annotate -> calibrate -> convert, and what every run shares;
- :mod:`~requant.stages.convert`: propagation, weight encoding, the QDQ model, bias correction, lint
  (:mod:`~requant.stages.joins`: the joins of ranges that cannot share a type it kept float);
- :mod:`~requant.stages.choose`: ``method="auto"``, the calibration method chosen on held-out samples;
- :mod:`~requant.stages.budget`: kernels kept float (``keep_float_below``, the accuracy budget);
- :mod:`~requant.stages.outputs`: every output against float, the ops feeding a poor one kept float;
- :mod:`~requant.stages.speed`: latency against float, the worst-priced groups kept float if no faster;
- :mod:`~requant.stages.check`: the int8 model against float on the evaluation data (agreement, tensors);
- :mod:`~requant.stages.lower`: the target's backend past QDQ (tosa-int8: the TOSA program, checked);
- :mod:`~requant.stages.report`: the report assembled from the sections, and its summary.
"""
