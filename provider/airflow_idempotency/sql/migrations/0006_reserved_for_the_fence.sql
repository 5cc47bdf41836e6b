-- Version 6 is the fence's (the lead's branch): this placeholder keeps the numbers without a gap
-- on the effects branch only. At merge, the fence's 0006 replaces it (delete this file).
SELECT 1;
