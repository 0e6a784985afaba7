"""Planning: how much memory a target, an artifact or a training job needs per GPU (`draftsmith plan`),
which method serves which domain (`draftsmith route`), and the acceptance a serving engine measures in
production (`draftsmith alpha`)."""
