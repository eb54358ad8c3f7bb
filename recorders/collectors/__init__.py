"""The collectors: what runs on the training path, one concern each.

`TrainingHooks` (`recorders/hooks.py`) assembles them around one `Shared`
(the step in progress, the pause depth, the row sink):

- `forward.ForwardCollector`: the root's and every watched module's
  forward hooks, micro-batches, the model's inputs and each call's inputs;
- `backward.BackwardCollector`: the gradients reaching each call's outputs
  and those its backward hands its inputs (autograd node hooks);
- `params.ParamGradCollector`: parameter gradients, the gradient norm at
  the end of each backward pass, the optimizer's pre-step hook;
- `recompute.CheckpointRecompute`: a reentrant checkpoint's recomputation,
  where its region's backward hooks are set;
- `autocast.AutocastWatch`: what autocast really ran;
- `graph_stats.GraphStats`: the cheap rows of modules traced into a
  compiled graph, computed there (what the hooks above run while dynamo
  traces them).

Every hook only enqueues device work and appends host-side metadata;
nothing here reads a device value.
"""
