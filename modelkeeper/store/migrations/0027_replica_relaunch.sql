-- 0027: relaunch in place (modelkeeper.domain.relaunch, docs/keeper.md "Relaunch in
-- place"). What the keeper said of a replica's last relaunch ("engine exited (signalled:
-- killed by SIGKILL); relaunched in place on n1, try 1 of 3 in 600 s"), written with its
-- state; NULL for a replica never relaunched.
ALTER TABLE replicas ADD COLUMN relaunch_note text;
